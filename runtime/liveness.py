"""Peer liveness: what a rank knows of its peers, and when it declares one lost.

Problem.  A rank that waits for a peer's data cannot tell, from the wait
alone, a slow peer from a dead, stopped or hung one; waiting forever is the
failure mode of most pipeline runtimes (NCCL's watchdog fires after ten
minutes).  pipeloom's ranks therefore exchange application-level heartbeats
on the control plane (each says what the sender is doing and for how long),
send ``bye`` when their Pipeline closes, and watch their control connections;
a waiting rank periodically asks whether some peer is gone.

Alternatives.  The decision used to live inside the actor, reading the wall
clock and the control plane's fields directly, so it could only be tested by
killing and stopping real rank processes and waiting out real timeouts.  Here
it is a small class with no sockets, tensors or event loop: the actor feeds
it what arrived (:meth:`PeerLiveness.seen`, :meth:`heartbeat`, :meth:`bye`)
and the control plane's connection events, and asks :meth:`check`.  Its clock
is injected (``clock=``), so tests drive time by hand, as trio's fake clock
does; the real ranks pass ``time.monotonic``.

The decision, for each peer, first match wins:

1. it said ``bye`` after completing at least ``step + 1`` steps: it finished
   this step and left; nothing is missing from it (not lost);
2. it said ``bye`` earlier: it stopped before this step and will not take part;
3. its control connection closed and a read of the connection events at least
   ``reconnect_grace`` later still showed it closed: the process is gone;
4. nothing from it for ``heartbeat_timeout`` (counted from the later of its
   last message and the start of this rank's current step): dead or unreachable;
5. its last heartbeat said it was busy in one action for longer than the stall
   budget that heartbeat carried (the peer's own ``stall_timeout``, or its
   ``first_step_stall_timeout`` in a cold step, when torch.compile compiles;
   this rank's ``stall_timeout`` for a peer that sent none): a hang or an
   endless loop in user code, or an action slower than the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

__all__ = ["PeerLiveness", "LostPeer", "RECONNECT_GRACE"]

#: seconds a peer's closed control connection must stay closed (seen by a later read of the
#: connection events, taken every heartbeat interval) before the peer counts as gone
RECONNECT_GRACE = 0.3


@dataclass(frozen=True)
class LostPeer:
    """A peer that :meth:`PeerLiveness.check` declared lost, and why (a sentence for the error)."""

    peer: int
    reason: str


#: waits that may last long with every rank waiting and the job still moving (a data-parallel reduction of a large
#: model over a slow network, the device's queue at a step's end): never taken for :meth:`PeerLiveness.all_waiting`
LONG_WAITS = frozenset({"data-parallel collectives", "sends to complete"})


class PeerLiveness:
    """One rank's view of its peers' liveness (single-threaded: the actor's loop calls it)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        heartbeat_timeout: float,
        stall_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        reconnect_grace: float = RECONNECT_GRACE,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        #: seconds of silence after which a peer is lost
        self.heartbeat_timeout = heartbeat_timeout
        #: seconds a peer may stay busy in one action while this rank waits
        self.stall_timeout = stall_timeout
        self.reconnect_grace = reconnect_grace
        self.clock = clock
        self._last_seen: dict[int, float] = {}
        #: peer -> (state, what, seconds in that state) from its last heartbeat
        self._state: dict[int, tuple[str, str, float]] = {}
        #: peer -> the stall budget (seconds) its last heartbeat granted its current step
        self._stall_budget: dict[int, float] = {}
        #: peer -> the step its last heartbeat was sent in, and when (this clock) that heartbeat arrived
        self._hb_step: dict[int, int | None] = {}
        self._hb_train: dict[int, bool | None] = {}
        self._hb_at: dict[int, float] = {}
        #: peers whose Pipeline closed, and how many steps each had completed
        self._bye_steps: dict[int, int] = {}
        self._bye_cause: dict[int, int] = {}
        self._listening_since = clock()

    @property
    def check_interval(self) -> float:
        """How often (seconds) a waiting rank should call :meth:`check`: a quarter of the timeout, at most 1 s."""
        return min(1.0, self.heartbeat_timeout / 4)

    # ------------------------------------------------------------ what arrived
    def start_step(self) -> None:
        """This rank starts a step: silence before now is not held against a peer."""
        self._listening_since = self.clock()

    def seen(self, peer: int) -> None:
        """Any message from ``peer`` arrived now."""
        self._last_seen[peer] = self.clock()

    def heartbeat(self, peer: int, state: str, what: str, for_s: float, *, stall_s: float | None = None,
                  step: int | None = None, train: bool | None = None) -> None:
        """``peer`` reports it is ``state`` (idle/busy/waiting) in ``what`` for ``for_s`` seconds.

        ``stall_s``: how long the peer allows one action of its current step to run (longer in
        a cold step, while torch.compile compiles); None keeps this rank's ``stall_timeout``.
        ``step``: the step the peer was in (for :meth:`all_waiting`), ``train``: its kind (for :meth:`other_kind`).
        """
        self._state[peer] = (state, what, for_s)
        self._hb_step[peer] = step
        self._hb_train[peer] = train
        self._hb_at[peer] = self.clock()
        if stall_s is not None:
            self._stall_budget[peer] = stall_s

    def bye(self, peer: int, steps: int, cause: int = -1) -> None:
        """``peer``'s Pipeline closed after completing ``steps`` steps (``cause``: the rank whose abort it had
        heard, -1 if none)."""
        self._bye_steps[peer] = steps
        self._bye_cause[peer] = cause
        self._state[peer] = ("idle", "", 0.0)

    # ------------------------------------------------------------ questions
    def left(self, peer: int) -> int | None:
        """Steps ``peer`` had completed when it said ``bye``; None if it has not."""
        return self._bye_steps.get(peer)

    def left_after_abort_of(self, peer: int) -> int | None:
        """The rank whose abort ``peer`` had heard when it said ``bye``; None if it has not said bye or heard none."""
        cause = self._bye_cause.get(peer, -1)
        return cause if cause >= 0 else None

    def last_heard(self, peer: int) -> float:
        """When (this clock) anything last arrived from ``peer``; 0.0 if nothing has."""
        return self._last_seen.get(peer, 0.0)

    def other_kind(self, step: int, train: bool) -> list[int]:
        """The peers whose last heartbeat says they run ``step`` (busy or waiting in it) as the other kind of step
        (evaluation where this rank trains, or the other way round): the ranks' calls disagree.  A step's index
        counts training and evaluation steps alike, so at one index every rank must run the same kind; only
        ``static_shapes=True`` has no per-step agreement that compares them first."""
        return [p for p, st in self._hb_step.items()
                if st == step and self._hb_train.get(p) is not None and self._hb_train[p] != train
                and self._state.get(p, ("idle", "", 0.0))[0] != "idle"]

    def all_waiting(self, step: int, what: str, waited: float, after: float) -> str | None:
        """Whether every rank has been waiting in ``step`` for at least ``after`` seconds with none running an
        action (this one waits for ``what``, since ``waited`` seconds): then nothing can move, as when the ranks'
        calls disagree in a way no per-step check saw (``static_shapes=True``: one rank in ``Pipeline.eval``
        while another is in ``Pipeline.step``: each waits for a transfer the other will never send, and their
        heartbeats keep flowing).  A description of every rank's wait, or None.  A peer not heard from lately
        is left to :meth:`check` (lost, not stuck)."""
        if waited < after or what in LONG_WAITS:
            return None
        now = self.clock()
        waits = [f"rank {self.rank} waits for {what or 'its inputs'} ({waited:.1f} s)"]
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            at = self._hb_at.get(peer)
            state, pwhat, for_s = self._state.get(peer, ("idle", "", 0.0))
            if (at is None or state != "waiting" or pwhat in LONG_WAITS or self._hb_step.get(peer) != step
                    or now - at > self.heartbeat_timeout / 2):
                return None
            if for_s + (now - at) < after:
                return None
            waits.append(f"rank {peer} waits for {pwhat or 'its inputs'} ({for_s + now - at:.1f} s)")
        return "; ".join(waits)

    def peer_states(self) -> dict[int, tuple[str, str, float]]:
        """Each peer's last reported (state, what, seconds), by rank (for debug dumps)."""
        return dict(self._state)

    def check(
        self,
        step: int,
        *,
        disconnected: Mapping[int, float] = {},
        events_read_at: float = 0.0,
        needed: Collection[int] | None = None,
    ) -> LostPeer | None:
        """The first peer (by rank) that is lost while this rank is in ``step``, or None.

        ``disconnected``: peer -> when (same clock) its control connection
        closed and has not come back; ``events_read_at``: when the connection
        events were last read (a disconnect counts once a read at least
        ``reconnect_grace`` after it still showed it).  ``needed``: the only
        peers to check (those this rank still waits on in the step; None: all).
        """
        now = self.clock()
        for peer in range(self.world_size):
            if peer == self.rank or (needed is not None and peer not in needed):
                continue
            last = self._last_seen.get(peer)
            silent = now - max(last if last is not None else 0.0, self._listening_since)
            state, what, busy_for = self._state.get(peer, ("idle", "", 0.0))
            busy_for += now - (last if last is not None else now)  # time since that heartbeat
            left = self._bye_steps.get(peer)
            gone = disconnected.get(peer)
            if left is not None:
                if step < left:
                    continue  # it finished this step and closed: nothing is missing from it
                reason = (
                    f"it closed its Pipeline after {left} step(s) while this rank is in step {step}: "
                    "it stopped early (an error outside a step?) and will not take part"
                )
            elif gone is not None and events_read_at - gone > self.reconnect_grace:
                reason = (
                    f"its control connection closed {now - gone:.1f} s ago and did not come back: "
                    "the process exited or was killed"
                )
            elif silent > self.heartbeat_timeout:
                reason = (
                    f"no heartbeat for {silent:.1f} s (timeout {self.heartbeat_timeout:g} s): the rank died, "
                    "was stopped, or its host is unreachable"
                )
            elif (state == "busy" and busy_for > (budget := self._stall_budget.get(peer, self.stall_timeout))
                  and silent <= self.heartbeat_timeout / 2):
                # (a stall is a peer that is *heard* while stuck in one action; one that fell silent
                # too, e.g. SIGSTOPped in that action, is named by the heartbeat timeout instead)
                reason = (
                    f"it has been running {what} for {busy_for:.1f} s (stall timeout {budget:g} s): "
                    "a hang or an endless loop in user code, or an action that is just this slow (a large "
                    "model, torch.compile recompiling); if so, raise the limit: `pipeloom launch "
                    "--stall-timeout SECONDS` or Pipeline(stall_timeout=..., first_step_stall_timeout=...)"
                )
            else:
                continue
            return LostPeer(peer, reason)
        return None
