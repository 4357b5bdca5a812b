"""Train a tiny Hugging Face causal LM with pipeline parallelism on CPU ranks.

    pipeloom launch --nproc-per-node 2 examples/train_hf.py
    pipeloom launch --nproc-per-node 2 examples/train_hf.py --family qwen2 --schedule ZBVZeroBubble

What it shows.  The model is a ``transformers`` ``LlamaForCausalLM`` (or
Qwen2/Mistral), random-initialised from a tiny config, nothing downloaded.
``pipeloom.hf.stage_fn_for_causal_lm`` cuts it into the schedule's stages
along the model's own pipeline plan and returns the causal-LM loss; every
stage runs Hugging Face's unmodified ``forward``.  ``--save`` then gathers
the stages' state dicts, whose keys are Hugging Face's own, and loads them
strictly into a fresh model of the same class on rank 0, which scores a
held-out batch with the trained weights.

The task: sequences from a fixed random permutation (the next token is
``perm[token]`` with probability 0.9, uniform otherwise), so the loss falls
from ln(vocab) within a few dozen steps.  Requires ``pip install pipeloom[hf]``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import pipeloom
from pipeloom.schedules import SCHEDULE_NAMES, ScheduleError, canonical_name, default_stages_per_rank, generate

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random-initialised causal LM of ``args.family`` (the same on every rank: seeded)."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[args.family])
    config = config_cls(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max(64, args.seq), tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return model_cls(config)


class PermutationData:
    """Sequences where each token is followed by ``perm[token]`` (p=0.9) or a uniform one."""

    def __init__(self, vocab: int, seq: int, seed: int) -> None:
        self.vocab, self.seq = vocab, seq
        self.gen = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))

    def batch(self, rows: int) -> torch.Tensor:
        x = torch.empty(rows, self.seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.vocab, (rows,), generator=self.gen)
        for t in range(1, self.seq):
            noise = torch.rand(rows, generator=self.gen) < 0.1
            x[:, t] = torch.where(noise, torch.randint(0, self.vocab, (rows,), generator=self.gen), self.perm[x[:, t - 1]])
        return x


def parse_args(argv: Sequence[str] | None, world: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def schedule(text: str) -> str:
        try:
            return canonical_name(text)
        except ScheduleError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p.add_argument("--family", choices=sorted(FAMILIES), default="llama", help="decoder family from transformers")
    p.add_argument("--schedule", type=schedule, default="1F1B", help=f"one of {', '.join(SCHEDULE_NAMES)}")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--microbatches", type=int, default=4, help="per step (DualPipeV needs 2 x ranks)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--hidden", type=int, default=32, help="hidden size (a multiple of 4 heads)")
    p.add_argument("--vocab", type=int, default=48)
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", type=Path, default=None, help="gather the trained state dict here and reload it into a fresh model")
    args = p.parse_args(argv)
    if args.hidden % 8:
        p.error(f"--hidden {args.hidden} must be a multiple of 8 (4 heads of even size)")
    if min(args.steps, args.microbatches, args.layers, args.vocab, args.seq) < 1:
        p.error("--steps, --microbatches, --layers, --vocab and --seq must be positive")
    if args.batch < args.microbatches:
        p.error(f"--batch {args.batch} is smaller than --microbatches {args.microbatches}")
    try:
        generate(args.schedule, num_ranks=world, num_microbatches=args.microbatches)
    except ScheduleError as exc:
        p.error(f"--schedule {args.schedule} with --microbatches {args.microbatches} on {world} ranks: {exc}")
    args.num_stages = world * default_stages_per_rank(args.schedule)
    if args.layers + 2 < args.num_stages:
        p.error(f"--layers {args.layers} is too few for {args.num_stages} stages: need at least {args.num_stages - 2}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        print("train_hf.py: error: start it with `pipeloom launch --nproc-per-node 2 examples/train_hf.py`", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("train_hf.py: error: needs transformers: pip install 'pipeloom[hf]'", file=sys.stderr)
        return 2
    from pipeloom.hf import stage_fn_for_causal_lm

    world = int(os.environ["WORLD_SIZE"])
    args = parse_args(argv, world)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # ranks share the machine's cores

    model = build_model(args)
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=args.num_stages)
    pipe = pipeloom.Pipeline(stage_fn, schedule=args.schedule, num_microbatches=args.microbatches, loss_fn=loss_fn)
    try:
        return train(pipe, args, model)
    finally:
        pipe.close()


def train(pipe: pipeloom.Pipeline, args: argparse.Namespace, model: torch.nn.Module) -> int:
    data = PermutationData(args.vocab, args.seq, args.seed + 1)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)
    reporter = pipe.has_last_stage
    if reporter:
        names = ", ".join("+".join(s) for s in stage_names(pipe))
        print(
            f"{type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e3:.1f}K params, "
            f"{args.num_stages} stages, {args.schedule} on {pipe.world_size} ranks; this rank: {names}; "
            f"loss starts near ln(vocab) = {math.log(args.vocab):.2f}",
            flush=True,
        )
    step_losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = data.batch(args.batch)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        pipe.step(ids, target=ids, losses=losses, return_outputs=False)  # labels are the inputs: the loss shifts them
        opt.step()
        if reporter:
            step_losses.append(float(torch.stack(losses).mean()))
            if step % 10 == 0 or step == args.steps:
                print(f"step {step:4d}  loss {step_losses[-1]:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    if reporter:
        k = max(1, min(5, len(step_losses) // 4))
        first, last = sum(step_losses[:k]) / k, sum(step_losses[-k:]) / k
        print(f"final: first_loss={first:.4f} last_loss={last:.4f} steps={args.steps} seconds={elapsed:.1f}", flush=True)
    if args.save is not None:
        save_and_reload(pipe, args, model, data)
    return 0


def stage_names(pipe: pipeloom.Pipeline) -> list[list[str]]:
    """What this rank's stages hold, by their top-level Hugging Face module names."""
    out = []
    for _, st in sorted(pipe.stages.items()):
        names = sorted({".".join(n.split(".")[:3]) if ".layers." in n else n.rsplit(".", 1)[0] for n, _ in st.named_parameters()})
        out.append(names)
    return out


def save_and_reload(pipe: pipeloom.Pipeline, args: argparse.Namespace, model: torch.nn.Module, data: PermutationData) -> None:
    """Every rank writes its stages' state dicts; rank 0 loads them all, strictly, into a fresh model."""
    import torch.distributed as dist

    from pipeloom.hf import causal_lm_loss

    args.save.mkdir(parents=True, exist_ok=True)
    state = {k: v for st in pipe.stages.values() for k, v in st.state_dict().items()}
    torch.save(state, args.save / f"rank{pipe.rank}.pt")
    dist.barrier()
    if pipe.rank != 0:
        return
    full: dict[str, torch.Tensor] = {}
    for r in range(pipe.world_size):
        full.update(torch.load(args.save / f"rank{r}.pt"))
    fresh = build_model(args)
    fresh.load_state_dict(full, strict=True)  # Hugging Face's own keys, every one of them
    ids = data.batch(args.batch)
    with torch.no_grad():
        loss = causal_lm_loss(fresh(ids, use_cache=False).logits, ids)
    print(f"reloaded: {len(full)} tensors into a fresh {type(fresh).__name__}; its held-out loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
