"""pipeloom.runtime: the per-rank actor loop and the public ``Pipeline`` API."""

from __future__ import annotations

from .actor import ActorStatistics, RankActor
from .errors import PeerLostError, PipelineConfigError, PipelineError, RemoteRankError, StageError
from .options import RuntimeOptions
from .pipeline import Microbatches, Pipeline, split_microbatches
from .split import split_by_fqn, stage_fn_from_pipe

__all__ = [
    "ActorStatistics",
    "Microbatches",
    "PeerLostError",
    "Pipeline",
    "PipelineConfigError",
    "PipelineError",
    "RankActor",
    "RemoteRankError",
    "RuntimeOptions",
    "StageError",
    "split_microbatches",
    "split_by_fqn",
    "stage_fn_from_pipe",
]
