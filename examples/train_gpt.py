"""Train a small GPT with pipeline parallelism on CPU ranks: pipeloom end to end.

    pipeloom launch --nproc-per-node 2 examples/train_gpt.py
    torchrun --nproc-per-node 2 examples/train_gpt.py --schedule ZBVZeroBubble

What it shows.  The model is written once, as for one process (token and
position embeddings, pre-LN transformer blocks with causal attention, a final
norm and an LM head); its forward tolerates the modules that other stages
own, which is the whole contract :func:`pipeloom.split_by_fqn` asks for.  The
model is built on the meta device, so no rank ever allocates the whole of it:
each stage is materialised and initialised (``init_weights``) where it runs.
Every rank builds the same ``Pipeline`` and calls ``step`` with the same batch;
``pipe.last_loss(reduce_to=0)`` brings each step's loss to rank 0, which draws
the progress bar (rich's ``Progress``: loss, tokens/s, ETA; on a terminal a live
bar, otherwise a line every ~5%) and prints the loss table at the end.

A trainer's other parts: gradients clipped by their global norm across
stages (``--clip``, ``pipe.clip_grad_norm_``), distributed checkpoints
(``--ckpt-dir``, ``--ckpt-every``: ``pipeloom.save_checkpoint``, written
asynchronously, keyed by the model's names) holding the model, AdamW, the
LR schedule, the data stream's position and the loss history, and
``--resume`` to continue from the latest complete one (also under another
number of ranks or another schedule)::

    pipeloom launch --nproc-per-node 2 --max-restarts 3 examples/train_gpt.py \
        --steps 2000 --ckpt-dir ckpt --ckpt-every 100 --resume

The task is synthetic but learnable: sequences drawn from a fixed random
Markov chain in which each token has three likely successors (probabilities
0.7/0.2/0.1).  A model that learned the chain reaches a loss near the chain's
entropy (0.80 nats), from ln(vocab) = 4.16 at the start, so a falling loss
is visible within a few dozen steps and its floor is known.

Flags are checked before any rank does work (a bad schedule/microbatch
combination is reported with the schedule's own rule); the exit status is 2
for a bad flag, like argparse.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipeloom
from pipeloom.schedules import SCHEDULE_NAMES, ScheduleError, canonical_name, default_stages_per_rank, generate

__all__ = ["GPT", "GPTConfig", "MarkovData", "stage_fqns", "main"]


# ---------------------------------------------------------------- model


class GPTConfig:
    """Sizes of the model (all counts; ``dim`` must be a multiple of ``heads``)."""

    def __init__(self, *, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        self.vocab, self.dim, self.heads, self.layers, self.seq = vocab, dim, heads, layers, seq


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then a 4x MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """A GPT whose forward runs whichever of its parts this pipeline stage holds.

    On a stage, modules owned by other stages are ``None`` (``tok``, ``pos``,
    ``norm``, ``head``) and ``layers`` holds only this stage's blocks, so the
    forward takes token ids where the embeddings are present and the previous
    stage's hidden states where they are not.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos: nn.Embedding | None = nn.Embedding(cfg.seq, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim)
        self.head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:
            h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation, for whichever modules this stage holds."""
        std = 0.02
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                # Residual projections scaled down with depth, as in GPT-2.
                scale = 1 / math.sqrt(2 * self.cfg.layers) if name.endswith((".proj", ".out")) else 1.0
                nn.init.normal_(m.weight, std=std * scale)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()


def stage_fqns(num_layers: int, num_stages: int) -> list[list[str]]:
    """Module names per stage: embeddings, blocks, norm+head cut into contiguous, even runs.

    The embeddings and the norm+head each count as one unit, like a block.
    """
    units = [["tok", "pos"], *([f"layers.{i}"] for i in range(num_layers)), ["norm", "head"]]
    if len(units) < num_stages:
        raise ValueError(
            f"{num_stages} stages need at least {num_stages - 2} layers (--layers {num_layers} is too few)"
        )
    base, extra = divmod(len(units), num_stages)
    out, i = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append([name for unit in units[i : i + n] for name in unit])
        i += n
    return out


# ---------------------------------------------------------------- data


class MarkovData:
    """Batches from a fixed random Markov chain: each token has 3 likely successors.

    Every rank builds the same chain and draws the same batches (one seed), so
    the first stage's inputs and the last stage's targets agree without any
    communication.
    """

    PROBS = (0.7, 0.2, 0.1)

    def __init__(self, vocab: int, seq: int, seed: int) -> None:
        self.vocab, self.seq = vocab, seq
        g = torch.Generator().manual_seed(seed)
        succ = torch.stack([torch.randperm(vocab, generator=g)[: len(self.PROBS)] for _ in range(vocab)])
        self.transition = torch.zeros(vocab, vocab)
        self.transition.scatter_(1, succ, torch.tensor(self.PROBS).expand(vocab, -1))
        self.gen = torch.Generator().manual_seed(seed + 1)

    def entropy(self) -> float:
        p = torch.tensor(self.PROBS)
        return float(-(p * p.log()).sum())

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): targets are the inputs shifted by one token."""
        toks = torch.empty(rows, self.seq + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, self.vocab, (rows,), generator=self.gen)
        for t in range(self.seq):
            toks[:, t + 1] = torch.multinomial(self.transition[toks[:, t]], 1, generator=self.gen).squeeze(1)
        return toks[:, :-1], toks[:, 1:]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# ---------------------------------------------------------------- progress


class TrainProgress:
    """Progress through rich: a live bar on a terminal; elsewhere (logs, launchers) a line every ~5%.

    rich's ``Progress`` keeps the speed estimate that gives the ETA either way.
    """

    def __init__(self, total: int, done: int = 0) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console()
        self.live = self.console.is_terminal
        self.total = total
        self.every = max(1, total // 20)
        self.bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s  |g| {task.fields[gnorm]:.2f}"),
            TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, disable=not self.live,
        )
        self.task = self.bar.add_task("train", total=total, completed=done, loss=float("nan"), tps=0.0, gnorm=0.0)
        self.bar.start()

    def update(self, step: int, *, loss: float, tokens_per_s: float, gnorm: float) -> None:
        self.bar.update(self.task, completed=step, loss=loss, tps=tokens_per_s, gnorm=gnorm)
        if not self.live and (step % self.every == 0 or step == self.total):
            eta = self.bar.tasks[0].time_remaining
            eta_text = "?" if eta is None else f"{int(eta) // 60}:{int(eta) % 60:02d}"
            print(f"step {step}/{self.total} loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  |g| {gnorm:.2f}  ETA {eta_text}", flush=True)

    def note(self, text: str) -> None:
        """A line that stays (an eval result, a checkpoint), above the live bar."""
        if self.live:
            self.bar.console.print(text, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        self.bar.stop()


def loss_table(history: Sequence[float], *, rows: int = 8) -> Any:
    """The loss curve as a table: mean, min and last loss over consecutive runs of steps."""
    from rich.table import Table

    table = Table(title="loss by steps", title_justify="left")
    for col in ("steps", "mean", "min", "last"):
        table.add_column(col, justify="right")
    n = len(history)
    bounds = [round(i * n / min(rows, n)) for i in range(min(rows, n) + 1)] if n else []
    for a, b in zip(bounds, bounds[1:]):
        part = history[a:b]
        table.add_row(f"{a + 1}-{b}", f"{sum(part) / len(part):.3f}", f"{min(part):.3f}", f"{part[-1]:.3f}")
    return table


# ---------------------------------------------------------------- flags


def default_microbatches(schedule: str, world: int) -> int:
    """4, or 2 per rank when that is more: valid for every named schedule (DualPipeV needs 2 x ranks)."""
    return max(4, 2 * world)


def parse_args(argv: Sequence[str] | None, world: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a small GPT on a synthetic Markov-chain task through pipeloom's pipeline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def positive(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
        return v

    def nonneg(text: str) -> int:
        return 0 if text.strip() == "0" else positive(text)

    def schedule(text: str) -> str:
        try:
            return canonical_name(text)
        except ScheduleError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def lr(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
        return v

    p.add_argument("--schedule", type=schedule, default="1F1B", help=f"one of {', '.join(SCHEDULE_NAMES)}")
    p.add_argument("--steps", type=positive, default=200, help="optimizer steps")
    p.add_argument("--microbatches", type=positive, default=None, help="per step (default: max(4, 2 x ranks))")
    p.add_argument("--layers", type=positive, default=4, help="transformer blocks")
    p.add_argument("--dim", type=positive, default=64, help="model width")
    p.add_argument("--heads", type=positive, default=4, help="attention heads (must divide --dim)")
    p.add_argument("--vocab", type=positive, default=64, help="vocabulary size of the Markov chain")
    p.add_argument("--seq", type=positive, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=positive, default=16, help="sequences per step (at least --microbatches)")
    p.add_argument("--lr", type=lr, default=3e-3, help="peak AdamW learning rate (10-step warmup, cosine decay to 10%%)")
    p.add_argument("--seed", type=int, default=0, help="seed of the chain, the data and the weights")
    p.add_argument("--eval-every", type=nonneg, default=50, help="steps between held-out evaluations (0: never)")

    def clip(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v >= 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
        return v

    p.add_argument("--clip", type=clip, default=1.0, help="clip gradients to this global L2 norm (0: no clipping)")
    p.add_argument("--ckpt-dir", default=None, help="directory of distributed checkpoints (step-N folders)")
    p.add_argument("--ckpt-every", type=nonneg, default=0,
                   help="steps between checkpoints (0: only at the end); needs --ckpt-dir")
    p.add_argument("--keep-last", type=positive, default=3, help="complete checkpoints kept in --ckpt-dir")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --ckpt-dir (a fresh start if there is none); "
                   "implied with --ckpt-dir when the launcher restarted the job (TORCHELASTIC_RESTART_COUNT > 0)")
    args = p.parse_args(argv)
    if args.ckpt_dir and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        args.resume = True  # a restarted job continues; it never starts over on top of its checkpoints
    if (args.resume or args.ckpt_every) and not args.ckpt_dir:
        p.error("--resume and --ckpt-every need --ckpt-dir")

    if args.microbatches is None:
        args.microbatches = default_microbatches(args.schedule, world)
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    if args.batch < args.microbatches:
        p.error(f"--batch {args.batch} is smaller than --microbatches {args.microbatches}: every microbatch needs a sequence")
    try:
        generate(args.schedule, num_ranks=world, num_microbatches=args.microbatches)
    except ScheduleError as exc:
        p.error(f"--schedule {args.schedule} with --microbatches {args.microbatches} on {world} ranks: {exc}")
    args.num_stages = world * default_stages_per_rank(args.schedule)
    if args.layers + 2 < args.num_stages:
        p.error(f"--layers {args.layers} is too few for {args.num_stages} stages: need at least {args.num_stages - 2}")
    return args


# ---------------------------------------------------------------- training


def main(argv: Sequence[str] | None = None) -> int:
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        print(
            "train_gpt.py: error: start it with `pipeloom launch --nproc-per-node 2 examples/train_gpt.py` "
            "or `torchrun --nproc-per-node 2 examples/train_gpt.py` (RANK and WORLD_SIZE are not set)",
            file=sys.stderr,
        )
        return 2
    world = int(os.environ["WORLD_SIZE"])
    args = parse_args(argv, world)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # ranks share the machine's cores

    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)
    with torch.device("meta"):
        model = GPT(cfg)  # the architecture only; no rank allocates all of it
    split = pipeloom.split_by_fqn(model, stage_fqns(args.layers, args.num_stages), device="cpu")

    def stage_fn(stage: int) -> nn.Module:
        # Seeded per stage, so a stage starts from the same weights whichever rank holds it.
        torch.manual_seed(args.seed * 1000 + stage)
        return split(stage)

    pipe = pipeloom.Pipeline(stage_fn, schedule=args.schedule, num_microbatches=args.microbatches, loss_fn=lm_loss)
    try:
        return train(pipe, args, cfg, sum(p.numel() for p in model.parameters()))
    finally:
        pipe.close()  # joins the runtime's threads


def train(pipe: pipeloom.Pipeline, args: argparse.Namespace, cfg: GPTConfig, num_params: int) -> int:
    data = MarkovData(cfg.vocab, cfg.seq, args.seed)
    held_out = MarkovData(cfg.vocab, cfg.seq, args.seed + 7919)
    held_out.transition = data.transition  # same chain, other sequences
    eval_x, eval_y = held_out.batch(args.batch)

    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = min(10, args.steps)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    reporter = pipe.rank == 0  # pipe.last_loss(reduce_to=0) brings every step's loss here
    history: list[float] = []  # per step, across resumes (it rides in the checkpoints)
    done = 0
    if args.resume:
        info = pipeloom.load_checkpoint(args.ckpt_dir, pipe, opt)
        if info is not None:
            done = info.step
            sched.load_state_dict(info.extra["sched"])
            data.gen.set_state(info.extra["data"])  # the data stream continues where it was
            history = list(info.extra["losses"])
            if reporter:
                print(f"resumed from {info.path} (step {done})", flush=True)
        elif reporter:
            print(f"no complete checkpoint in {args.ckpt_dir}: starting from step 0", flush=True)
    if reporter:
        print(
            f"GPT {num_params / 1e6:.2f}M params ({cfg.layers} layers, dim {cfg.dim}), {args.num_stages} stages, "
            f"{args.schedule} on {pipe.world_size} ranks, {args.microbatches} microbatches of "
            f"{args.batch // args.microbatches}+ sequences x {cfg.seq} tokens; "
            f"loss floor (the chain's entropy) {data.entropy():.2f}",
            flush=True,
        )
    progress = TrainProgress(args.steps, done) if reporter else None

    def save(step: int) -> None:
        extra = {"sched": sched.state_dict(), "data": data.gen.get_state(), "losses": history}
        pending = pipeloom.save_checkpoint(args.ckpt_dir, pipe, opt, step=step, extra=extra, async_save=True,
                                           keep_last=args.keep_last)
        if progress is not None:
            progress.note(f"checkpoint of step {step} -> {pending.path} (written in the background)")

    tokens = args.batch * cfg.seq
    start = time.perf_counter()
    for step in range(done + 1, args.steps + 1):
        x, y = data.batch(args.batch)
        opt.zero_grad(set_to_none=True)
        pipe.step(x, target=y, return_outputs=False)  # the loss is all this loop needs
        loss = pipe.last_loss(reduce_to=0)
        gnorm = float(pipe.clip_grad_norm_(args.clip)) if args.clip else float("nan")
        opt.step()
        sched.step()
        if progress is not None and loss is not None:
            history.append(loss)
            progress.update(step, loss=loss, tokens_per_s=(step - done) * tokens / (time.perf_counter() - start), gnorm=gnorm)
        if args.eval_every and step % args.eval_every == 0:
            pipe.eval(eval_x, target=eval_y)
            ev = pipe.last_loss(reduce_to=0)
            if progress is not None:
                progress.note(f"eval at step {step}: held-out loss {ev:.3f}")
        if args.ckpt_dir and (step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0)):
            save(step)
    pipeloom.wait_checkpoints()  # before the process group goes
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
        if history:
            progress.console.print(loss_table(history))
            k = max(1, min(10, len(history) // 4))
            first, last = sum(history[:k]) / k, sum(history[-k:]) / k
            ran = args.steps - done
            print(
                f"final: first_loss={first:.4f} last_loss={last:.4f} (mean of the first and last {k} steps) "
                f"steps={args.steps} seconds={elapsed:.1f} tokens_per_s={ran * tokens / max(elapsed, 1e-9):,.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
