"""One rank of the Hugging Face adapter's integration test, and the models it trains.

Started by ``tests/test_hf.py`` through ``harness.spawn_ranks`` with a JSON job
``{"out": DIR, "cases": [{"id", "family", "schedule", "microbatches", "padding"}...]}``.
Every case builds the same seeded, random-initialised float64 causal LM of
``family`` (nothing is downloaded), pipelines it with
``pipeloom.hf.stage_fn_for_causal_lm``, runs one ``Pipeline.step`` and saves,
per rank, every local parameter's gradient under its Hugging Face name and
the losses, to ``DIR/{id}-rank{R}.pt``.  One process group serves every case.

The models and the batch live here so the test process builds exactly the same.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

__all__ = ["FAMILIES", "build_hf_model", "make_hf_batch", "main"]

VOCAB = 40
LAYERS = 6
#: family -> (config class, model class), both from transformers
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    # sliding and full attention layers by position (layers 0-4 slide over 3 tokens, 5 attends fully): split with
    # the other stages' layers kept in place (pipeloom.hf's aligned split)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
#: family -> its config's arguments beside the common ones
EXTRA = {"gemma3": {"head_dim": 4, "sliding_window": 3}}


def build_hf_model(family: str, *, layers: int = LAYERS, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A tiny random-initialised causal LM of ``family`` (no download)."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    config = config_cls(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        **EXTRA.get(family, {}),
    )
    torch.manual_seed(seed)
    return model_cls(config).to(dtype)


def make_hf_batch(batch: int = 8, seq: int = 7, *, padding: bool = False, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, attention_mask or None); with padding, some rows are left-padded and their pads ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    if not padding:
        return ids, labels, None
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(0, batch, 3):
        pad = 1 + row % (seq - 2)
        mask[row, :pad] = 0
        labels[row, :pad] = -100
    return ids, labels, mask


def main() -> None:
    import torch.distributed as dist

    import pipeloom
    from pipeloom.hf import stage_fn_for_causal_lm
    from pipeloom.schedules import default_stages_per_rank

    job = json.load(open(sys.argv[1]))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for case in job["cases"]:
        ids, labels, mask = make_hf_batch(padding=case.get("padding", False))
        model = build_hf_model(case["family"])
        num_stages = world * default_stages_per_rank(case["schedule"])
        stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=num_stages)
        pipe = pipeloom.Pipeline(stage_fn, schedule=case["schedule"], num_microbatches=case["microbatches"], loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {} if mask is None else {"attention_mask": mask}
        pipe.step(ids, target=labels, losses=losses, **kwargs)
        result = {
            "grads": {n: p.grad.clone() for m in pipe.stages.values() for n, p in m.named_parameters() if p.grad is not None},
            "params": sorted(n for m in pipe.stages.values() for n, _ in m.named_parameters()),
            "losses": [l.clone() for l in losses],
            "stages": sorted(pipe.stages),
            "last": pipe.schedule.num_stages - 1 in pipe.stages,
        }
        pipe.close()
        torch.save(result, os.path.join(job["out"], f"{case['id']}-rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
