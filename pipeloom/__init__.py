"""pipeloom: an event-driven pipeline-parallel training runtime for PyTorch.

The public surface: ``Pipeline`` (build a rank's stages and run steps),
``Microbatches`` (pre-cut inputs of varying shapes), ``Replicate`` (a value
given whole to every microbatch), the model-splitting
helpers and the error types.  Schedules live in ``pipeloom.schedules``.

The runtime names are imported lazily so that ``pipeloom.schedules`` and the
``pipeloom schedule`` command stay torch-free and start instantly.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_RUNTIME_NAMES = (
    "CheckpointError",
    "CheckpointReadError",
    "CheckpointTimeoutError",
    "CheckpointInfo",
    "MeasuredCandidate",
    "Microbatches",
    "PeerLostError",
    "Pipeline",
    "PipelineConfigError",
    "PipelineError",
    "PipelineGradScaler",
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
    "split_by_fqn",
    "split_by_tracing",
    "stage_fn_from_pipe",
    "verify_split",
    "wait_checkpoints",
)

__all__ = [*_RUNTIME_NAMES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_NAMES:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'pipeloom' has no attribute {name!r}")
