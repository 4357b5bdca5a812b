"""Inputs that change over a job's life, on real gloo ranks, against the unsplit model (float64).

Each case (``tests/ranks/shapes_adv_worker.py``) runs a script of steps and evals on a 2-rank Pipeline and on the
unsplit model in every rank's process, comparing outputs, losses, ``last_loss()``, every gradient and the batch's
gradient after each op.  Scripts change, between steps and between microbatches: rows (uneven cuts, a last
microbatch of 1 row), sequence length, ``pipeloom.Microbatches`` of different shapes, the batch's dtype (float32,
float64, bf16), ``requires_grad`` of the batch, a keyword tensor that comes and goes, a ``Replicate`` value whose
shape follows the sequence, ``eval`` with other batch sizes, ``return_outputs`` / ``losses=``, ``forward_only``
Pipelines; stage kinds: tuples and dicts of outputs with varying shapes, a non-tensor in the last stage's output,
data-dependent output shapes (a slice) and ``requires_grad`` (a detached branch), identity stages (the output
is the input), token ids (int64) handed between stages, and a long run through many shapes (the learned layouts
are bounded, and none is served stale).  Schedules 1F1B, GPipe, Interleaved1F1B, ZBVZeroBubble, DualPipeV; with
``RuntimeOptions(static_shapes=None | True | False)``.

Where the runtime must refuse, the worker predicts it from the unsplit model (see its docstring): a step of
static shapes whose transfers differ from what was learned for it fails on every rank within seconds, the
failing rank's error naming rank, step, stage, microbatch and action and what to do; a non-tensor handed
between stages is refused naming the same.  Every other op must equal the unsplit model, and under static shapes
run without headers exactly where its transfers were learned before (the learned layouts stay at most 16).

Bugs these rows found (regression tests now):
- the last stage's outputs whose shapes beyond dim 0 differ between microbatches (a data-dependent slice; rows
  ``slice-*``): merging them with ``torch.cat`` raised torch's "Sizes of tensors must match" on the last stage's
  rank after the step had ended everywhere, failing the step there alone (its peer went on into ``last_loss()``
  and waited 15 s for "lost rank -1"); they come back per microbatch (``Microbatches``), as for pre-cut inputs.
- ``static_shapes`` auto (the default) keyed a non-tensor keyword input other than a plain scalar by its type alone
  (rows ``cast-*``: ``dtype=torch.float32`` then ``torch.float64``, which the stages cast their outputs to): the
  second step was served the first one's learned transfers and failed as if the model's shapes were
  data-dependent ("needs static_shapes=False"); a dtype, device, Enum, slice... is keyed by its value now.
- ``static_shapes`` auto keyed the learned transfers by the inputs alone (rows ``freeze-*``): a stage frozen whole
  for some steps (a warm-up that trains the later stages only) hands on an activation that needs no gradient from
  the same inputs, and that step failed the same way; the layout now holds a digest of each rank's trainable set,
  parameter shapes and train/eval modes (the fingerprint that already decides a cold step).
- dict outputs of the last stage came back as a list of dicts, one per microbatch (rows ``dict-*``), where torch's
  ``merge_chunks`` joins them key by key; and tuples whose length differed between microbatches were cut to the
  shortest by ``zip``, silently: dicts are merged now, structures that differ come back per microbatch
  (``test_merge_outputs_by_structure``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_job  # noqa: E402

WORKER = Path(__file__).parent / "ranks" / "shapes_adv_worker.py"
ALL = ["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]
MODES = {"auto": None, "static": True, "headers": False}


def step(rows: int, T: int | None = 3, **kw: Any) -> dict[str, Any]:
    return dict(op="step", rows=rows, T=T, seed=len(kw) * 7 + rows * 31 + (T or 0), **kw)


def ev(rows: int, T: int | None = 3, **kw: Any) -> dict[str, Any]:
    return dict(step(rows, T, **kw), op="eval")


def mbs(shapes: list[tuple[int, int]], op: str = "step", **kw: Any) -> dict[str, Any]:
    return dict(op=op, mbs=shapes, seed=sum(r * 7 + t for r, t in shapes), **kw)


# rows and sequence length change between steps and microbatches; uneven cuts; eval of another batch size
ROWS = [step(8), step(8), step(6), step(8, 5), step(7, 5), step(5, 2), ev(12), step(8),
        mbs([(2, 3), (2, 4), (1, 5), (3, 2)]), mbs([(2, 3), (2, 4), (1, 5), (3, 2)]), ev(4, 2), step(8)]
# dtype and requires_grad of the batch
DTYPE = [step(8, dtype="f32"), step(8, dtype="f64"), step(8, dtype="bf16"), step(8, dtype="f32"),
         step(8, rg=True), step(8), step(8, rg=True), ev(8, rg=True), step(6, dtype="f32", rg=True)]
# keyword tensors that come and go, a Replicate whose shape follows the sequence
KWARGS = [step(8, scale=True), step(8), step(8, bias=True), step(8, 5, bias=True), step(8, 5, scale=True, bias=True),
          ev(6, 5, bias=True), step(8, 3, scale=True), step(8)]
# return_outputs and losses= alternating
OUTS = [step(8, ret=False, losses=False), step(8), ev(8, ret=False), ev(8, losses=False), step(6, ret=False),
        step(6, ret=True, losses=False), ev(4, ret=True)]
# forward_only: eval only
EVALS = [ev(8), ev(8), ev(6, 5), ev(5, 2), mbs([(1, 3), (2, 2), (1, 1), (2, 4)], op="eval"), ev(8)]
# the outputs' shapes follow the sequence
VARY = [step(8), step(8, 5), ev(6, 2), step(7, 4), mbs([(2, 3), (1, 4), (2, 2), (1, 5)])]
# data-dependent: the same inputs' layout, microbatches marked (stage 0 slices / detaches them) differently
MARKED = [step(8, marks=[0, 1, 0, 0]), step(8, marks=[0, 1, 0, 0]), step(6, marks=[1, 1, 0, 1]),
          step(8, marks=[1, 0, 0, 0])]
# many layouts (more than the 16 remembered), then the first ones again
MANY = [step(4 + r % 5, 2 + r // 5) for r in range(20)] + [step(4, 2), step(5, 2), step(4 + 19 % 5, 2 + 19 // 5)]


# the batch's requires_grad toggled, alone (static_shapes=True: the transfers stay the same)
RG = [step(8), step(8, rg=True), step(8), ev(8, rg=True), step(8, rg=True), ev(8)]
# a keyword input that is not a tensor (a dtype the stages cast their outputs to), then stage 0 frozen for a step
CAST = [step(8, cast="f64"), step(8, cast="f32"), step(8, cast="f64"), step(8, cast="f32")]
FREEZE = [step(8), step(8, freeze=[0]), step(8), step(8, freeze=[0])]


def _cases() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, schedule: str, mode: str, script: list[dict[str, Any]], **cfg: Any) -> None:
        out.append(dict(id=f"{name}-{schedule}-{mode}", schedule=schedule, static=MODES[mode], microbatches=4,
                        model=cfg.pop("model", "base"), script=script, **cfg))

    # (rows of one pool of 2 ranks, about 40 s on 2 cores: every schedule and mode for rows and batch sizes, the
    # others spread over the schedules; a static_shapes=True row ends at its first change, refused)
    # (name, script, extra config, the (schedule, mode) pairs it runs under)
    table: list[tuple[str, list[dict[str, Any]], dict[str, Any], list[tuple[str, str]]]] = [
        ("rows", ROWS, {}, [(s, "auto") for s in ALL] + [(s, "headers") for s in ("1F1B", "ZBVZeroBubble", "DualPipeV")]
         + [(s, "static") for s in ("1F1B", "Interleaved1F1B", "DualPipeV")]),
        ("dtype", DTYPE, {}, [("1F1B", "auto"), ("ZBVZeroBubble", "headers"), ("ZBVZeroBubble", "static")]),
        ("rg", RG, {}, [("ZBVZeroBubble", "static")]),
        ("kwargs", KWARGS, {}, [("ZBVZeroBubble", "auto"), ("1F1B", "headers"), ("1F1B", "static")]),
        ("outs", OUTS, {}, [("GPipe", "auto")]),
        ("evals", EVALS, {"forward_only": True}, [("DualPipeV", "auto"), ("1F1B", "static")]),
        ("dict", VARY, {"model": "tuple", "last_out": "dict"}, [("ZBVZeroBubble", "auto"), ("DualPipeV", "headers")]),
        ("tuple", VARY, {"model": "tuple", "last_out": "tuple"}, [("Interleaved1F1B", "auto")]),
        ("str", VARY, {"model": "tuple", "last_out": "str"}, [("1F1B", "auto")]),
        ("ids", VARY, {"model": "ids"}, [("1F1B", "auto"), ("ZBVZeroBubble", "headers")]),
        ("slice", MARKED, {"model": "slice"}, [("1F1B", "auto"), ("ZBVZeroBubble", "headers"), ("DualPipeV", "static")]),
        ("detach", MARKED, {"model": "detach"}, [("1F1B", "static"), ("ZBVZeroBubble", "auto"), ("DualPipeV", "headers")]),
        ("nontensor", [step(8)], {"model": "nontensor", "refuse": "to cross a stage boundary"}, [("1F1B", "auto")]),
        ("cast", CAST, {}, [("1F1B", "auto"), ("ZBVZeroBubble", "auto")]),
        ("freeze", FREEZE, {}, [("1F1B", "auto"), ("ZBVZeroBubble", "auto"), ("ZBVZeroBubble", "static")]),
        ("many", MANY, {}, [("1F1B", "auto")]),
    ]
    for name, script, extra, where in table:
        for sched, mode in where:
            add(name, sched, mode, script, **extra)
    # identity stages: which stages are the identity differs by schedule
    for sched, mode, ident in (("1F1B", "auto", [0]), ("ZBVZeroBubble", "auto", [1, 2]), ("DualPipeV", "headers", [0, 2])):
        add("ident", sched, mode, DTYPE, ident=ident)
    return out


_ONLY = [x for x in os.environ.get("SHAPES_ONLY", "").split(",") if x]
CASES = [c for c in _cases() if not _ONLY or any(c["id"].startswith(o) for o in _ONLY)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("shapes")
    return asyncio.run(run_job(2, WORKER, CASES, base / "out", base, timeout=300))


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_changing_inputs(results: dict[str, list[dict[str, Any]]], case_id: str) -> None:
    cfg = next(c for c in CASES if c["id"] == case_id)
    ranks = results[case_id]
    for r, res in enumerate(ranks):
        assert not res["errors"], f"rank {r}: {res['errors'][0]}"
        assert not res["diffs"], f"rank {r}: differs from the unsplit model: {json.dumps(dict(list(res['diffs'].items())[:12]), indent=1)}"
    script = cfg["script"]
    ops0 = ranks[0]["ops"]
    must = next((o["i"] for o in ops0 if o["must_fail"]), 0 if cfg.get("refuse") else None)
    for r, res in enumerate(ranks):
        ops = res["ops"]
        failed = [o for o in ops if "error" in o]
        if must is None:
            assert not failed, f"rank {r}: op {failed[0]['i']} ({script[failed[0]['i']]}) failed: {failed[0]['error']}"
            assert len(ops) == len(script), f"rank {r}: ran {len(ops)} of {len(script)} ops"
            continue
        assert failed and failed[0]["i"] == must, (
            f"rank {r}: op {must} ({script[must]}) must fail"
            + (f"; op {failed[0]['i']} failed: {failed[0]['error']}" if failed else ", it ran"))
        err = failed[0]["error"]
        assert failed[0]["seconds"] < 15, f"rank {r}: the failure took {failed[0]['seconds']:.1f} s: {err}"
        if err.startswith("StageError"):  # the rank whose stage met it (the receiver may choke on the placeholder)
            assert f"rank {r}, step {must}, stage " in err and ", microbatch " in err and ", action " in err, err
        else:
            assert err.startswith("RemoteRankError"), err
    errs = [res["ops"][must]["error"] for res in ranks] if must is not None else []
    # the sender's error says what happened and what to do
    want = cfg.get("refuse") or "static shapes (static_shapes="
    assert not errs or any(e.startswith("StageError") and want in e for e in errs), errs
    # static shapes: a step runs without headers exactly where its transfers were learned (the same layout within
    # the last 16, or static_shapes=True after the first step of its kind); the layouts remembered stay bounded
    for i, o in enumerate(ops0):
        if "error" in o:
            break
        sent = [res["ops"][i]["headerless"] for res in ranks]
        if o["learned"]:
            assert max(sent) > 0, f"op {i} ({script[i]}): learned before, yet every transfer carried a header: {sent}"
        else:
            assert sent == [0, 0], f"op {i} ({script[i]}): new, yet sent without headers: {sent}"
        assert all(res["ops"][i]["known"] <= 16 for res in ranks), [res["ops"][i]["known"] for res in ranks]


def test_merge_outputs_by_structure() -> None:
    """The last stage's per-microbatch outputs joined as torch's ``merge_chunks`` joins them: dicts key by key (a
    ``ModelOutput``-like mapping rebuilt as its own type), ``None`` fields kept ``None``; structures that differ
    between microbatches (other keys, tuples of other lengths: ``zip`` used to drop the extra items) come back as
    the list of the microbatches' outputs."""
    from collections import OrderedDict

    import torch

    from pipeloom.runtime.pipeline import _merge

    class Out(OrderedDict):  # (a Hugging Face ModelOutput takes its fields as keywords)
        def __init__(self, **kw: Any) -> None:
            super().__init__(**{k: v for k, v in kw.items() if v is not None})

    a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0, 9.0).view(1, 3)
    got = _merge([{"y": a, "n": None, "tag": "x"}, {"y": b, "n": None, "tag": "x"}], precut=False)
    assert list(got) == ["y", "n", "tag"] and torch.equal(got["y"], torch.cat([a, b])) and got["n"] is None and got["tag"] == ["x", "x"]
    got = _merge([Out(logits=a, loss=None), Out(logits=b, loss=None)], precut=False)
    assert type(got) is Out and list(got) == ["logits"] and torch.equal(got["logits"], torch.cat([a, b]))
    nested = _merge([{"h": (a, {"z": a})}, {"h": (b, {"z": b})}], precut=False)
    assert torch.equal(nested["h"][1]["z"], torch.cat([a, b]))
    other_keys = [{"y": a}, {"y": b, "extra": b}]
    assert _merge(other_keys, precut=False) == other_keys
    other_lengths = [(a, a), (b,)]
    assert _merge(other_lengths, precut=False) == other_lengths
    assert _merge([None, None], precut=False) is None
