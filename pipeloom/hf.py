"""Pipeline a Hugging Face causal LM: ``stage_fn`` and loss from the model itself.

``pip install pipeloom[hf]`` installs ``transformers``; this module imports it
only to recognise its models, so it is safe to import without it.

The problem: a ``transformers`` decoder (``LlamaForCausalLM`` and kin) is one
``forward`` that embeds tokens, builds the causal mask and the rotary
embeddings, runs every decoder layer, normalises and projects to the
vocabulary, and returns a ``ModelOutput`` with a KV cache.  Cutting it into
stages by hand means rewriting that forward per stage against internals that
transformers renames between releases.  Alternatives:

* trace it (``pipeloom.split_by_tracing``): needs ``use_cache=False``, fixes
  every shape to the example microbatch, and the mask and rotary tables
  become values that skip stages (pipeloom routes them through the stages
  between, at the cost of sending them on every hop);
* a wrapper per stage that calls HF internals (works, and breaks with them);
* what transformers' own ``base_model_pp_plan`` and torchtitan's Hugging
  Face backend assume, and this module does: split by module names with
  :func:`pipeloom.split_by_fqn` and pass-through placeholders.  Every stage
  is the model's own class running its own, unmodified ``forward``: the
  modules another stage owns hand their input on, the decoder layers of
  other stages are absent from ``layers``, and the rotary embedding (buffers
  only) is copied to every stage, which recomputes the mask, positions and
  ``cos``/``sin`` for itself (cheap, and nothing but hidden states crosses a
  stage boundary).  Parameter names stay the model's
  (``model.layers.3.self_attn.q_proj.weight``), so Hugging Face state dicts
  and checkpoints load into the stages by name.

How a stage is called: stage 0 with the token ids (``input_ids``), every
later stage with the previous stage's hidden states as ``inputs_embeds``;
every stage with ``use_cache=False`` and the step's keyword inputs (an
``attention_mask`` with padding reaches every stage, so each builds the same
mask).  Every stage returns the ``logits`` field of its ``ModelOutput``,
which on all but the last stage holds the hidden states (the LM head there
is a pass-through).

Which stage holds what: the modules the plan lists before the decoder
layers (the token embedding) go to stage 0, those after them (the final
norm) and the model's own head (``lm_head``, from its ``_pp_plan``) to the
last stage, and the decoder layers are spread over the stages, evenly by
default, or ``layer_splits`` layers per stage.  Models without a plan are
split the same way around their one ``nn.ModuleList`` of layers.

Limits: the forward must map hidden states to hidden states through every
module it does not own (true of Llama, Qwen2, Mistral and the other
decoders with a ``base_model_pp_plan``; not of GPT-2, which adds a position
embedding to the token embedding, nor of models that scale the embedding
in the model's forward, like Gemma 1/2).  Tied input and output embeddings
cannot span stages (each stage would train its own copy): build the model
with ``tie_word_embeddings=False`` or give the head its own weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .runtime.errors import PipelineConfigError
from .runtime.split import reduce_output, split_by_fqn

__all__ = ["causal_lm_loss", "stage_fn_for_causal_lm", "stage_names_for_causal_lm"]

IGNORE_INDEX = -100


def causal_lm_loss(logits: Any, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token cross-entropy, as Hugging Face computes it for causal LMs.

    ``logits`` (batch, seq, vocab) at position *t* are scored against
    ``labels`` at *t + 1* (labels are the input ids, not shifted by the
    caller); labels equal to ``ignore_index`` (-100, padding) do not count.
    The mean is over the counted tokens of this microbatch.  Half-precision
    logits are scored in float32; float32 and float64 stay as they are
    (transformers' own loss casts to float32, which would cost a float64 run
    its precision).  A ``ModelOutput`` is accepted for ``logits``.
    """
    if not isinstance(logits, torch.Tensor):
        logits = reduce_output(logits, "logits")
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"causal_lm_loss wants logits (batch, seq, vocab) and labels (batch, seq), "
            f"got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _layout(model: nn.Module) -> tuple[list[str], str, int, list[str]]:
    """(names before the layers, the layers' name, how many layers, names after them), all full names."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        raise PipelineConfigError(
            f"{type(model).__name__} is not a Hugging Face model with a head over a base model "
            f"(base_model_prefix {prefix!r}); pass a *ForCausalLM model"
        )
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or getattr(type(base), "base_model_pp_plan", None)
    children = [(n, m) for n, m in base.named_children() if m is not None]
    lists = [n for n, m in children if isinstance(m, nn.ModuleList) and _has_params(m)]
    if plan:
        planned = [n for n in plan if n in dict(children)]
        layer_names = [n for n in planned if isinstance(base._modules[n], nn.ModuleList)]
    else:
        planned, layer_names = [], lists
    if len(layer_names) != 1:
        raise PipelineConfigError(
            f"{type(base).__name__} should hold its decoder layers in one nn.ModuleList; found "
            f"{', '.join(layer_names) or 'none'} (children: {', '.join(n for n, _ in children)})"
        )
    layers = layer_names[0]
    order = [n for n, _ in children]
    # Modules with parameters before the layers go first, after them last; the plan's order
    # decides for the modules it lists, registration order for the others.
    before, after = [], []
    for n, m in children:
        if n == layers or not _has_params(m):
            continue
        if n in planned:
            side = planned.index(n) < planned.index(layers)
        else:
            side = order.index(n) < order.index(layers)
        (before if side else after).append(f"{prefix}.{n}")
    heads = [n for n, m in model.named_children() if n != prefix and m is not None and _has_params(m)]
    return before, f"{prefix}.{layers}", len(base._modules[layers]), after + heads


def _even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: as even as it goes, the remainder to the middle stages first.

    Stage 0 also holds the embedding and the last stage the norm and the
    head, so when the layers do not divide evenly the extra ones go where
    nothing else is.
    """
    base, rem = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    middle = list(range(1, num_stages - 1))
    for s in (middle + [0, num_stages - 1])[:rem]:
        counts[s] += 1
    return counts


def stage_names_for_causal_lm(
    model: nn.Module, *, num_stages: int | None = None, layer_splits: Sequence[int] | None = None
) -> list[list[str]]:
    """The module names each stage keeps (what :func:`stage_fn_for_causal_lm` hands ``split_by_fqn``)."""
    before, layers, num_layers, after = _layout(model)
    if layer_splits is not None:
        counts = [int(c) for c in layer_splits]
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise PipelineConfigError(
                f"layer_splits {list(layer_splits)} must be non-negative layer counts, one per stage, "
                f"summing to the model's {num_layers} decoder layers"
            )
        if num_stages is not None and num_stages != len(counts):
            raise PipelineConfigError(f"num_stages={num_stages} but layer_splits has {len(counts)} entries")
    elif num_stages is None:
        raise PipelineConfigError("give num_stages (the schedule's stage count) or layer_splits")
    else:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise PipelineConfigError(f"num_stages must be a positive int, got {num_stages!r}")
        counts = _even_split(num_layers, num_stages)
    n = len(counts)
    names: list[list[str]] = []
    first = 0
    for s, c in enumerate(counts):
        stage = [*(before if s == 0 else []), *(f"{layers}.{i}" for i in range(first, first + c)), *(after if s == n - 1 else [])]
        first += c
        if not stage:
            raise PipelineConfigError(
                f"stage {s} of {n} would hold no decoder layer and nothing else: {num_layers} layers "
                f"fill at most {num_layers + 2} stages (the first also holds the embedding, the last the head)"
            )
        names.append(stage)
    return names


class _CausalLMInputs:
    """Forward pre-hook: ``use_cache=False`` everywhere; later stages take hidden states as ``inputs_embeds``."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {**kwargs, "use_cache": False}
        if "labels" in kwargs:
            raise PipelineConfigError(
                "labels were passed to the stages; pass them as the step's target "
                "(pipe.step(input_ids, target=labels)): the loss is the pipeline's loss_fn"
            )
        if self.index > 0:
            if len(args) != 1:
                raise TypeError(f"stage {self.index} expects the previous stage's hidden states, got {len(args)} inputs")
            kwargs["inputs_embeds"] = args[0]
            args = ()
        return args, kwargs


class _CausalLMStageFn:
    """``stage_fn`` of :func:`stage_fn_for_causal_lm`: a ``split_by_fqn`` stage with the input hook."""

    def __init__(self, split: Any) -> None:
        self._split = split
        self.num_stages: int = split.num_stages
        self.stage_fqns: tuple[tuple[str, ...], ...] = split.stage_fqns

    def __call__(self, index: int) -> nn.Module:
        stage = self._split(index)
        stage.register_forward_pre_hook(_CausalLMInputs(index), with_kwargs=True)
        return stage

    def __repr__(self) -> str:
        return f"stage_fn_for_causal_lm({self._split!r})"


def stage_fn_for_causal_lm(
    model: nn.Module,
    *,
    num_stages: int | None = None,
    layer_splits: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> tuple[Callable[[int], nn.Module], Callable[[Any, torch.Tensor], torch.Tensor]]:
    """``(stage_fn, loss_fn)`` for ``pipeloom.Pipeline`` over a Hugging Face causal LM.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` model (Llama, Qwen2,
            Mistral...), left untouched: each stage is a pruned deep copy.
        num_stages: the schedule's stage count (ranks x stages per rank:
            ``pipeloom.schedules.default_stages_per_rank(name)``).
        layer_splits: decoder layers per stage instead of an even split,
            e.g. ``[3, 4, 4, 3]``; its length is the stage count.
        device: where a model on the meta device is materialised (see
            ``split_by_fqn``).

    Returns:
        ``stage_fn(i) -> nn.Module`` (attributes ``num_stages`` and
        ``stage_fqns``) and :func:`causal_lm_loss`.  Call the pipeline as
        ``pipe.step(input_ids, target=input_ids)`` (labels are shifted by
        the loss; use -100 for tokens not to score), optionally with
        ``attention_mask=`` for padding.

    Raises:
        PipelineConfigError: a model without a head over a base model, no
            single ModuleList of layers, more stages than the layers can
            fill, bad ``layer_splits``, or tied embeddings across stages.
    """
    names = stage_names_for_causal_lm(model, num_stages=num_stages, layer_splits=layer_splits)
    inp, out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if len(names) > 1 and callable(inp) and callable(out):
        emb, head = inp(), out()
        if emb is not None and head is not None and getattr(emb, "weight", None) is getattr(head, "weight", 0):
            raise PipelineConfigError(
                f"{type(model).__name__} ties its input and output embeddings (tie_word_embeddings=True), "
                "and they would sit on the first and the last stage, each training its own copy; build it with "
                "tie_word_embeddings=False, or untie: model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())"
            )
    split = split_by_fqn(model, names, device=device, placeholder="identity", output_field="logits")
    return _CausalLMStageFn(split), causal_lm_loss
