"""Confirm a tuner's ranking by measuring its top candidates in the running job.

``pipeloom schedule tune`` ranks configurations by *simulated* step time.  Its
model is good to a few percent (``benchmarks/RESULTS.md``: median error 4-6% on
GPUs), which is as large as the difference between the first few candidates:
on 2 x H200 (session T) its first pick was 9% slower than its third, predicted
2.7% apart.  The remedy every autotuner uses is to let the model prune and a
measurement decide: :func:`measure_candidates` builds each of a few candidates
in the job itself, runs a few training steps of each, and returns them fastest
first, every rank with the same answer.

A step's time is the slowest rank's, from a barrier before it to the end of its
device work (``torch.cuda.synchronize`` on GPUs): the time a training loop
would see.  Candidates are measured in ``rounds``, the order reversed every
other round, each candidate built anew per round (so only one is alive at a
time: memory for one), and a candidate's time is the median of its timed steps
over all rounds, so that a burst of load on the host hits several candidates
alike instead of one.  The gradients the measured steps leave are dropped
(``grad = None``) after every step; no optimizer steps, so every candidate
trains from the same weights when ``build`` makes them from the same seed.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerLostError, PipelineConfigError
from .pipeline import handled_failures

__all__ = ["MeasuredCandidate", "TuneCandidate", "measure_candidates"]


@dataclass(frozen=True, kw_only=True)
class TuneCandidate:
    """One configuration to measure; ``build`` turns it into a Pipeline."""

    schedule: str
    """A schedule name (``Pipeline(schedule=...)``)."""
    num_microbatches: int
    """``Pipeline(num_microbatches=...)``."""
    stages_per_rank: int | None = None
    """``Pipeline(stages_per_rank=...)``; None: the schedule's default."""
    split: tuple[int, ...] | None = None
    """Layers per stage, for a ``build`` whose stage function splits a model (``pipeloom schedule tune``'s
    searched split); None: ``build``'s own."""
    label: str = ""
    """A name for reports; default: the schedule, microbatches, stages per rank and split."""

    def name(self) -> str:
        if self.label:
            return self.label
        v = f" v={self.stages_per_rank}" if self.stages_per_rank else ""
        sp = f" ({','.join(map(str, self.split))})" if self.split else ""
        return f"{self.schedule} m={self.num_microbatches}{v}{sp}"

    @classmethod
    def from_tune(cls, row: dict[str, Any]) -> TuneCandidate:
        """One of ``pipeloom schedule tune --json``'s ``candidates`` (keys ``schedule``, ``microbatches``,
        ``stages_per_rank`` and ``split``: the layers per stage where the tuner had a layer model)."""
        try:
            split = row.get("split")
            return cls(schedule=str(row["schedule"]), num_microbatches=int(row["microbatches"]),
                       stages_per_rank=int(row["stages_per_rank"]) if row.get("stages_per_rank") is not None else None,
                       split=tuple(int(x) for x in split) if split else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise PipelineConfigError(f"not a row of `pipeloom schedule tune --json`'s ranking: {row!r} ({exc})") from None


    @classmethod
    def top_from_tune(cls, doc: dict[str, Any], k: int = 3) -> list[TuneCandidate]:
        """The first ``k`` candidates of a ``pipeloom schedule tune --json`` document that fit its memory cap."""
        rows = doc.get("candidates") if isinstance(doc, dict) else None
        if not isinstance(rows, list):
            raise PipelineConfigError("not a `pipeloom schedule tune --json` document (no list under 'candidates')")
        return [cls.from_tune(r) for r in rows if r.get("fits", True)][:k]


@dataclass(frozen=True)
class MeasuredCandidate:
    """What :func:`measure_candidates` found for one candidate (the same on every rank)."""

    candidate: TuneCandidate
    step_ms: float | None
    """The median over the timed steps of every round of the slowest rank's step time (ms); None if refused."""
    steps_ms: tuple[float, ...] = field(default=())
    """Every timed step's time (ms), in the order run."""
    refused: str = ""
    """Why the candidate was not measured (an error ``build`` or a step raised on some rank), else ''."""

    def to_json(self) -> dict[str, Any]:
        return {"candidate": {k: v for k, v in asdict(self.candidate).items()}, "name": self.candidate.name(),
                "step_ms": self.step_ms, "steps_ms": list(self.steps_ms), "refused": self.refused}


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree(candidates: Sequence[TuneCandidate], rounds: int, warmup: int, steps: int) -> None:
    """Every rank must measure the same list the same way (else their steps would pair with other candidates')."""
    mine = json.dumps([[asdict(c) for c in candidates], rounds, warmup, steps], sort_keys=True)
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    for r, other in enumerate(got):
        if other != mine:
            raise PipelineConfigError(
                f"measure_candidates: rank {r} was given other candidates or settings than rank {dist.get_rank()} "
                f"(rank {r}: {other}; rank {dist.get_rank()}: {mine}): every rank must pass the same list")


def _refusals(err: BaseException | None) -> list[str]:
    """Every rank's error (empty string: none), gathered, so that all ranks skip a candidate together."""
    mine = "" if err is None else f"rank {dist.get_rank()}: {type(err).__name__}: {err}"
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    return [g for g in got if g]


def _release(pipe: Any) -> None:
    if pipe is not None:
        try:
            pipe.close()
        except Exception:  # noqa: BLE001 - a candidate that failed may fail to close too; measure the next
            pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_candidates(
    candidates: Sequence[TuneCandidate],
    build: Callable[[TuneCandidate], Any],
    *args: Any,
    target: Any = None,
    warmup: int = 2,
    steps: int = 4,
    rounds: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    **kwargs: Any,
) -> list[MeasuredCandidate]:
    """Measure each candidate's training step in this job; the candidates fastest first (refused ones last).

    ``build(candidate)`` returns a :class:`~pipeloom.Pipeline` for it (the caller maps the candidate onto its
    stage function, e.g. ``split`` onto ``split_by_fqn``); it is closed after the candidate's steps.
    ``args``, ``target`` and ``kwargs`` are given to every ``step`` (the same global batch for every
    candidate, as the tuner's ranking assumes).  Every rank must call this with the same candidates and
    settings (checked).  The default process group must exist (``torch.distributed.init_process_group``
    once, before: a Pipeline that created it would destroy it at ``close``).  A candidate whose ``build``
    or step raises on any rank is reported refused, with every rank's error, and the others are measured
    (such errors are not reported to ``pipeloom launch`` as the job's failure); a lost rank
    (:class:`~pipeloom.PeerLostError`) is raised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise PipelineConfigError("measure_candidates needs the default process group: call "
                                  "torch.distributed.init_process_group() once before it (a Pipeline that creates the group "
                                  "destroys it at close, and each candidate's Pipeline is closed)")
    if not candidates:
        raise PipelineConfigError("measure_candidates: no candidates")
    if warmup < 0 or steps < 1 or rounds < 1:
        raise PipelineConfigError(f"measure_candidates: warmup >= 0, steps >= 1 and rounds >= 1 needed "
                                  f"(got warmup={warmup}, steps={steps}, rounds={rounds})")
    if "return_outputs" in kwargs:
        raise PipelineConfigError("measure_candidates runs its steps with return_outputs=False; do not pass it")
    _agree(candidates, rounds, warmup, steps)
    times: list[list[float]] = [[] for _ in candidates]
    refused = [""] * len(candidates)
    backend = dist.get_backend()
    for rnd in range(rounds):
        order = range(len(candidates)) if rnd % 2 == 0 else range(len(candidates) - 1, -1, -1)
        for i in order:
            if refused[i]:
                continue
            pipe, err = None, None
            try:
                with handled_failures():
                    pipe = build(candidates[i])
            except PeerLostError:
                raise  # a rank is gone: the job's failure, not the candidate's
            except Exception as exc:  # noqa: BLE001 - reported below, on every rank
                err = exc
            errs = _refusals(err)
            if errs:
                refused[i] = "build: " + "; ".join(errs)
                _release(pipe)
                continue
            device = getattr(pipe, "device", None)
            device = torch.device(device) if device is not None else None
            elapsed = torch.zeros(1, device=device if backend == "nccl" else "cpu", dtype=torch.float64)
            err = None
            try:
                for k in range(warmup + steps):
                    if backend == "nccl" and device is not None and device.type == "cuda":
                        dist.barrier(device_ids=[device.index])
                    else:
                        dist.barrier()
                    _sync(device)
                    t0 = clock()
                    with handled_failures():
                        pipe.step(*args, target=target, return_outputs=False, **kwargs)
                    _sync(device)
                    elapsed.fill_(clock() - t0)
                    for p in pipe.parameters():
                        p.grad = None
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                    if k >= warmup:
                        times[i].append(float(elapsed.item()) * 1e3)
            except PeerLostError:
                _release(pipe)
                raise
            except Exception as exc:  # noqa: BLE001 - the runtime failed the step on every rank; report it
                err = exc
            errs = _refusals(err)
            if errs:
                refused[i] = "step: " + "; ".join(errs)
                times[i] = []
            _release(pipe)
    out = [MeasuredCandidate(c, statistics.median(t) if t and not refused[i] else None, tuple(t), refused[i])
           for i, (c, t) in enumerate(zip(candidates, times))]
    return sorted(out, key=lambda m: (m.step_ms is None, m.step_ms if m.step_ms is not None else 0.0))
