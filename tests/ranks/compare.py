"""What the adversarial sweeps' workers compare: a tensor of the pipeline against the unsplit model's, diffs recorded."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TOL", "TensorDiffs"]

TOL = dict(rtol=1e-10, atol=1e-12)


class TensorDiffs:
    """``diffs``: what differs, by name: None on one side only, a shape, NaNs in other places, or the largest
    difference beyond :data:`TOL` (float64; NaNs in the same places count as equal)."""

    def __init__(self) -> None:
        self.diffs: dict[str, Any] = {}

    def tensors(self, what: str, got: Any, want: Any) -> None:
        if (got is None) != (want is None):
            self.diffs[what] = f"got {'None' if got is None else 'a tensor'}, the unsplit model has {'None' if want is None else 'a tensor'}"
            return
        if got is None:
            return
        got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
        if got.shape != want.shape:
            self.diffs[what] = f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
            return
        both_nan = torch.isnan(got) & torch.isnan(want)
        if not torch.equal(torch.isnan(got), torch.isnan(want)):
            self.diffs[what] = "NaN in other places"
            return
        g, w = got.masked_fill(both_nan, 0), want.masked_fill(both_nan, 0)
        if not torch.allclose(g, w, **TOL, equal_nan=True):
            self.diffs[what] = float((g - w).abs().max())
