"""pipeloom.runtime: the per-rank actor loop and the public ``Pipeline`` API."""

from __future__ import annotations

from .actor import ActorStatistics, RankActor
from .autotune import MeasuredCandidate, TuneCandidate, measure_candidates
from .checkpoint import CheckpointInfo, PendingCheckpoint, latest_checkpoint, load_checkpoint, save_checkpoint, wait_checkpoints
from .errors import CheckpointError, CheckpointReadError, CheckpointTimeoutError, PeerLostError, PipelineConfigError, PipelineError, RemoteRankError, StageError
from .checks import Replicate
from .expert_parallel import StageContext
from .grad_scaler import PipelineGradScaler
from .options import RuntimeOptions
from .pipeline import Microbatches, Pipeline, split_microbatches
from .split import split_by_fqn
from .split_check import verify_split
from .traced_split import split_by_tracing, stage_fn_from_pipe

__all__ = [
    "ActorStatistics",
    "CheckpointError",
    "CheckpointReadError",
    "CheckpointTimeoutError",
    "CheckpointInfo",
    "PendingCheckpoint",
    "MeasuredCandidate",
    "Microbatches",
    "PeerLostError",
    "Pipeline",
    "PipelineConfigError",
    "PipelineError",
    "PipelineGradScaler",
    "RankActor",
    "RemoteRankError",
    "Replicate",
    "RuntimeOptions",
    "StageContext",
    "StageError",
    "TuneCandidate",
    "latest_checkpoint",
    "load_checkpoint",
    "measure_candidates",
    "save_checkpoint",
    "split_microbatches",
    "split_by_fqn",
    "split_by_tracing",
    "stage_fn_from_pipe",
    "verify_split",
    "wait_checkpoints",
]
