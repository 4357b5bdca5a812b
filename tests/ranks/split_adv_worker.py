"""One rank of tests/test_split_adversarial.py: Hugging Face models split into stages, on real gloo ranks.

``python split_adv_worker.py JOB.json`` on every rank (the harness's rank pool); JOB is
``{"out": DIR, "cases": [...]}``.  Each case builds a tiny random-initialised float64 causal LM (``cfg``/``cls``
from transformers, ``config`` overrides; ``ckpt``: HF gradient checkpointing, ``"reentrant"`` or
``"nonreentrant"``), splits it with ``pipeloom.hf.stage_fn_for_causal_lm`` (or, ``traced``, with
``pipeloom.split_by_tracing`` at ``model.layers.2``), runs one ``Pipeline.step`` of 4 microbatches and compares
every gradient of the stages this rank holds, and the losses, with the unsplit model run on this rank over the
same microbatches (``compare: "self"``: with the same pipeline built without checkpointing, deterministic,
dropout on: the recomputation must draw the forward's masks).  Writes ``DIR/rank{R}.json``: per case the
largest relative gradient difference, the loss difference, names whose gradient is None on one side only, the
RuntimeWarnings that mention checkpointing, and for ``compare: "self"`` how far the gradients are from the
model's without dropout (dropout really drew).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

import pipeloom
from pipeloom.hf import causal_lm_loss, stage_fn_for_causal_lm
from pipeloom.schedules import default_stages_per_rank

VOCAB, N, ROWS = 40, 4, 8


def build(case: dict[str, Any], ckpt: Any = None) -> torch.nn.Module:
    import transformers

    kw: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                              tie_word_embeddings=False)
    kw.update(case.get("config", {}))
    torch.manual_seed(0)
    cfg = getattr(transformers, case.get("cfg", "LlamaConfig"))(**kw)
    model = getattr(transformers, case.get("cls", "LlamaForCausalLM"))(cfg).double()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    return model


def batch(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(input ids, labels, keyword inputs); ``pad``: rows 0, 3, 6 left-padded (mask 0, label -100)."""
    g = torch.Generator().manual_seed(1)
    seq = case.get("seq", 7)
    ids = torch.randint(3, VOCAB, (ROWS, seq), generator=g)
    labels = ids.clone()
    kw: dict[str, torch.Tensor] = {}
    if case.get("pad"):
        mask = torch.ones_like(ids)
        for row in range(0, ROWS, 3):
            mask[row, : 1 + row % (seq - 2)] = 0
        labels[mask == 0] = -100
        kw["attention_mask"] = mask
    return ids, labels, kw


def reference(case: dict[str, Any], train: bool = False) -> tuple[dict[str, torch.Tensor | None], list[torch.Tensor]]:
    """The unsplit model over the same microbatches: gradients (the mean of the microbatches' losses) and losses."""
    model = build(case).train(train)
    ids, labels, kw = batch(case)
    losses = []
    for m in range(N):
        part = {k: v.tensor_split(N)[m] for k, v in kw.items()}
        logits = model(ids.tensor_split(N)[m], use_cache=False, **part).logits
        loss = causal_lm_loss(logits, labels.tensor_split(N)[m])
        (loss / N).backward()
        losses.append(loss.detach())
    return {n: p.grad for n, p in model.named_parameters()}, losses


def piped(case: dict[str, Any], ckpt: Any) -> tuple[dict[str, torch.Tensor | None], list[torch.Tensor], list[str]]:
    model = build(case, ckpt)
    ids, labels, kw = batch(case)
    ns = dist.get_world_size() * default_stages_per_rank(case["schedule"])
    if case.get("traced"):
        from torch.distributed.pipelining import SplitPoint

        rows = ROWS // N
        stage_fn = pipeloom.split_by_tracing(
            model, example_args=(ids[:rows],), example_kwargs={"use_cache": False, **{k: v[:rows] for k, v in kw.items()}},
            split_spec={"model.layers.2": SplitPoint.BEGINNING})
        loss_fn = lambda out, y: causal_lm_loss(out[0] if isinstance(out, tuple) else out, y)  # noqa: E731
    else:
        stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=ns)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe = pipeloom.Pipeline(stage_fn, schedule=case["schedule"], num_microbatches=N, loss_fn=loss_fn,
                                 deterministic=case.get("deterministic", False))
        try:
            losses: list[torch.Tensor] = []
            pipe.step(ids, target=labels, losses=losses, **kw)
            grads = {n: p.grad for m in pipe.stages.values() for n, p in m.named_parameters()}
        finally:
            pipe.close()
    notes = sorted({str(w.message).split(".")[0][:160] for w in seen
                    if issubclass(w.category, RuntimeWarning) and "checkpoint" in str(w.message)})
    return grads, losses, notes


def compare(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> tuple[float, list[str]]:
    worst, none = 0.0, []
    for n, g in got.items():
        w = want[n]
        if (g is None) != (w is None):
            none.append(n)
        elif g is not None and w is not None:
            worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)))
    return worst, none


def main() -> None:
    job = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # (transformers' notices; the checkpointing ones are recorded in piped)
    dist.init_process_group("gloo")
    report: dict[str, Any] = {}
    for case in job["cases"]:
        row: dict[str, Any] = {}
        got, got_losses, row["notes"] = piped(case, case.get("ckpt"))
        if case.get("compare") == "self":
            want, want_losses, _ = piped(case, None)
            nodrop, _ = reference({**case, "config": {**case.get("config", {}), "attention_dropout": 0.0}}, train=True)
            row["vs_no_dropout"] = compare(got, nodrop)[0]
        else:
            want, want_losses = reference(case)
        row["grad"], row["none"] = compare(got, want)
        row["params"] = len(got)
        if got_losses:
            row["loss"] = float((torch.stack(got_losses) - torch.stack(want_losses)).abs().max())
        report[case["id"]] = row
    json.dump(report, open(os.path.join(job["out"], f"rank{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
