"""Error types a user can act on, each naming where the failure happened.

One type per failure: the code that raised (this rank's stage), another rank
that raised, a peer that disappeared, and a pipeline that was set up wrongly.
Every message names the rank, and where known the stage, the microbatch and
the action, because "Connection closed by peer" on seven ranks tells nobody
which of the eight broke.
"""

from __future__ import annotations

__all__ = [
    "PipelineError",
    "PipelineConfigError",
    "StageError",
    "RemoteRankError",
    "PeerLostError",
    "CheckpointError",
    "CheckpointTimeoutError",
    "CheckpointReadError",
]


def _where(rank: int, step: int | None, stage: int | None, microbatch: int | None, action: str | None) -> str:
    parts = [f"rank {rank}"]
    if step is not None:
        parts.append(f"step {step}")
    if stage is not None:
        parts.append(f"stage {stage}")
    if microbatch is not None:
        parts.append(f"microbatch {microbatch}")
    if action is not None:
        parts.append(f"action {action}")
    return ", ".join(parts)


class PipelineError(RuntimeError):
    """Base class of pipeloom's runtime errors."""


class PipelineConfigError(PipelineError, ValueError):
    """The pipeline was set up wrongly (schedule, world size, stage modules, inputs)."""


class StageError(PipelineError):
    """An action failed on this rank (user code or runtime); the cause is chained."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        step: int | None = None,
        stage: int | None = None,
        microbatch: int | None = None,
        action: str | None = None,
    ) -> None:
        self.rank, self.step, self.stage, self.microbatch, self.action = rank, step, stage, microbatch, action
        super().__init__(f"{_where(rank, step, stage, microbatch, action)}: {message}")


class RemoteRankError(PipelineError):
    """Another rank failed; its own error and traceback are carried here."""

    def __init__(
        self,
        *,
        rank: int,
        failed_rank: int,
        step: int | None,
        stage: int | None,
        microbatch: int | None,
        action: str | None,
        error: str,
        remote_traceback: str,
    ) -> None:
        self.rank, self.failed_rank = rank, failed_rank
        self.stage, self.microbatch, self.action, self.step = stage, microbatch, action, step
        self.error, self.remote_traceback = error, remote_traceback
        super().__init__(
            f"rank {rank} stopped because rank {failed_rank} failed "
            f"({_where(failed_rank, step, stage, microbatch, action)}): {error}"
        )


class PeerLostError(PipelineError):
    """A peer rank disappeared (its connection closed or it fell silent)."""

    def __init__(self, message: str, *, rank: int, peer: int) -> None:
        self.rank, self.peer = rank, peer
        super().__init__(f"rank {rank}: lost rank {peer}: {message}")


class CheckpointError(PipelineError):
    """A checkpoint call failed on some rank (its own error is carried in the message); every rank raises it,
    so none is left waiting in the call's next collective.  ``failed_ranks``: the ranks that failed."""

    def __init__(self, message: str, *, rank: int, failed_ranks: list[int]) -> None:
        self.rank, self.failed_ranks = rank, list(failed_ranks)
        super().__init__(message)


class CheckpointTimeoutError(CheckpointError):
    """A checkpoint call whose ranks did not all arrive within its ``timeout``: a rank that did not call it, or that
    hangs inside it (a write that blocks, an asynchronous save that never completes).  Every live rank raises it;
    ``failed_ranks`` are the ranks that did not arrive (empty where that is not known), ``call`` names the call."""

    def __init__(self, message: str, *, rank: int, failed_ranks: list[int], call: str, timeout: float | None) -> None:
        self.call, self.timeout = call, timeout
        super().__init__(message, rank=rank, failed_ranks=failed_ranks)


class CheckpointReadError(CheckpointError):
    """A complete checkpoint (by its marker) that cannot be read: a truncated or missing data file, a garbled
    metadata file or marker.  ``load_checkpoint`` of a root falls back to the next older complete checkpoint; of
    an explicit ``step-N`` directory it raises this on every rank."""
