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
  other stages are absent from ``layers`` (or, in an aligned split, pass-through
  entries at their indices: see Limits), and the rotary embedding (buffers
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
module it does not own and do nothing else to them (true of Llama, Qwen2,
Mistral, OLMo, Phi, Gemma and most decoders with a ``base_model_pp_plan``;
not of Cohere, Gemma 2 or Granite, whose forwards scale or cap the logits or
the embeddings on every stage).  An embedding before the layers other than
the token embedding (GPT-2's, GPT-Neo's and StarCoder's position embedding)
is taken as added to it: on the later stages it adds nothing (a pass-through
would add the position ids); a dropout module the base model holds outside
the layers goes to its side (GPT-2's after the embeddings: stage 0).  :func:`verify_causal_lm_split` (run by
:func:`stage_fn_for_causal_lm` unless ``verify=False``) finds such a model on
a small copy of its class and config and refuses it, so a split never
computes another model silently.  A forward that picks each layer's
attention kind by its position in the layer list (Gemma 3, GPT-OSS, Qwen2
with sliding windows) gets the other stages' layers kept in place as
pass-throughs (``stage_fn.aligned``), where the check confirms that split.  Modules the plan lists go to their side
even without parameters (a weightless final norm, an embedding dropout).
Tied input and output embeddings (``tie_word_embeddings=True``: Llama-3.2-1B,
Qwen's small models) on the first and the last stage are trained as one
weight: the two stages share one parameter object per process, held by a
:class:`TiedEmbeddings` that the stage function keeps alive, and the
``Pipeline`` finds that tie across ranks (``runtime/ties.py``), starts every
copy from the lowest holding rank's and sums the copies' gradients after each
training step (``RuntimeOptions.tied_weights="sync"``, the default; with
``"refuse"`` the Pipeline refuses it, naming the tie).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .runtime.errors import PipelineConfigError
from .runtime.split import reduce_output, split_by_fqn

__all__ = ["TiedEmbeddings", "causal_lm_loss", "stage_fn_for_causal_lm", "stage_names_for_causal_lm", "verify_causal_lm_split"]

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
    # (a module the plan lists goes to its side even without parameters: a final norm without weights, OLMo's,
    # runs once at the end, not on every stage; unlisted ones without parameters, rotary tables, are on every stage)
    before, after = [], []
    for n, m in children:
        # (an unlisted dropout, GPT-2's after its embeddings, goes to its side too: on every stage it dropped the
        # hidden states once per stage in training, which no check in eval mode sees)
        if n == layers or (not _has_params(m) and n not in planned and not isinstance(m, nn.modules.dropout._DropoutNd)):
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
    """Forward pre-hook: ``use_cache=False`` everywhere; later stages take hidden states as ``inputs_embeds``.
    (A pure mapping of the call's arguments: ``RuntimeOptions.cuda_graphs`` captures it with the module.)"""

    _pipeloom_graph_safe = True

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


class _AbsentLayer(nn.Module):
    """A decoder layer that another stage owns, kept at its index in the stage's layer list (``aligned``): it hands
    the hidden states on, in the form the model's layers return them, and carries the real layer's plain attributes
    (``attention_type``, ``layer_idx``, ...), so a forward that walks ``enumerate(self.layers)`` and picks each
    layer's attention kind by position counts the real layers' positions on every stage."""

    def __init__(self, index: int, attrs: dict[str, Any], tuple_output: bool) -> None:
        super().__init__()
        for k, v in attrs.items():
            setattr(self, k, v)
        self._index = index
        self._tuple_output = tuple_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        h = args[0] if args else kwargs.get("hidden_states")
        return (h,) if self._tuple_output else h

    def extra_repr(self) -> str:
        return f"decoder layer {self._index}: on another pipeline stage (a pass-through here)"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(f"decoder layer {self.__dict__.get('_index')} is on another pipeline stage; this stage "
                                 f"holds a pass-through in its place, which has no {name!r}") from None


def _plain_attrs(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and (v is None or isinstance(v, (bool, int, float, str)))}


class TiedEmbeddings(nn.Module):
    """One parameter under every name the model ties it by (``model.embed_tokens.weight``, ``lm_head.weight``): what
    the stages of a model with tied input and output embeddings share in this process.  Kept alive by the stage
    function, it is the model the ``Pipeline`` finds the tie in (``runtime/ties.py``, rule 2: its key,
    ``TiedEmbeddings:<first name>``, is the same on every rank), and keeps the copies of the ranks holding the
    first and the last stage equal (``RuntimeOptions.tied_weights``)."""

    def __init__(self, names: Sequence[str], weight: nn.Parameter) -> None:
        super().__init__()
        for name in names:
            *path, leaf = name.split(".")
            node: nn.Module = self
            for part in path:
                if part not in node._modules:
                    node.add_module(part, nn.Module())
                node = node._modules[part]  # type: ignore[assignment]
            node.register_parameter(leaf, weight)


class _NoEmbedding(nn.Module):
    """On the stages after the first, an embedding that the first stage adds to the token embedding (GPT-2's
    position embedding, ``wpe``): the model's forward adds it again to the hidden states it is given, and a
    pass-through would add its input (the position ids); this adds nothing (a zero that broadcasts, of no dtype
    that would promote the hidden states')."""

    def __init__(self, replaces: str) -> None:
        super().__init__()
        self.replaces = replaces

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        ref = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        return torch.zeros((), device=None if ref is None else ref.device)

    def extra_repr(self) -> str:
        return f"replaces {self.replaces!r}, added by stage 0"


def _added_embeddings(model: nn.Module, before: Sequence[str]) -> tuple[str, ...]:
    """The embeddings before the layers other than the token embedding (GPT-2's ``transformer.wpe``): assumed
    added to it (:class:`_NoEmbedding` on later stages); :func:`verify_causal_lm_split` finds a model where not."""
    inp = getattr(model, "get_input_embeddings", None)
    tokens = inp() if callable(inp) else None
    return tuple(n for n in before if isinstance(m := model.get_submodule(n), nn.Embedding) and m is not tokens)


class _CausalLMStageFn:
    """``stage_fn`` of :func:`stage_fn_for_causal_lm`: a ``split_by_fqn`` stage with the input hook (and, ``aligned``,
    the layers other stages own as :class:`_AbsentLayer` entries at their indices: ``(layer list name, each layer's
    plain attributes, whether layers return tuples)``; ``tied``: the names the model ties its input and output
    embeddings' weight by, which the stages built here share as one parameter, :attr:`tied`)."""

    def __init__(self, split: Any, aligned: tuple[str, list[dict[str, Any]], bool] | None = None,
                 tied: Sequence[str] = (), added: Sequence[str] = ()) -> None:
        self._split = split
        #: embeddings the first stage adds to the token embedding (:class:`_NoEmbedding` on the later stages)
        self.added = tuple(added)
        self.num_stages: int = split.num_stages
        self.stage_fqns: tuple[tuple[str, ...], ...] = split.stage_fqns
        self.aligned = aligned
        self._tied_names = tuple(tied)
        #: the tied embeddings' one parameter in this process (made from the first stage built that holds an end)
        self.tied: TiedEmbeddings | None = None
        #: the stage indices built since :attr:`tied` was last reset: an index asked for again starts another set of
        #: stages (another Pipeline built from this stage_fn), which gets a parameter of its own, from its own copy
        #: (sharing the first set's carried that Pipeline's trained embedding into the new one's untrained model)
        self._built: set[int] = set()

    def _share_tied(self, stage: nn.Module) -> None:
        """The stage's ends of the tied embeddings made this process's one parameter (the stage is a deep copy)."""
        held = [n for n, _ in stage.named_parameters(remove_duplicate=False) if n in self._tied_names]
        if not held:
            return
        if self.tied is None:
            self.tied = TiedEmbeddings(self._tied_names, stage.get_parameter(held[0]))
        weight = self.tied.get_parameter(self._tied_names[0])
        for name in held:
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner).register_parameter(leaf, weight)

    def __call__(self, index: int) -> nn.Module:
        stage = self._split(index)
        if index in self._built:
            self.tied, self._built = None, set()
        self._built.add(index)
        if self._tied_names:
            self._share_tied(stage)
        if index > 0:
            for name in self.added:
                owner, _, leaf = name.rpartition(".")
                stage.get_submodule(owner)._modules[leaf] = _NoEmbedding(name)
        if self.aligned is not None:
            name, attrs, tuple_output = self.aligned
            layers = stage.get_submodule(name)
            kept = dict(layers._modules)
            layers._modules.clear()
            for i, a in enumerate(attrs):
                layers._modules[str(i)] = kept[str(i)] if str(i) in kept else _AbsentLayer(i, a, tuple_output)
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
    verify: bool = True,
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
        verify: first run a small model of the same class and config whole
            and split (:func:`verify_causal_lm_split`, well under a second)
            and refuse a model whose stages would not compose to it.

    Returns:
        ``stage_fn(i) -> nn.Module`` (attributes ``num_stages`` and
        ``stage_fqns``) and :func:`causal_lm_loss`.  Call the pipeline as
        ``pipe.step(input_ids, target=input_ids)`` (labels are shifted by
        the loss; use -100 for tokens not to score), optionally with
        ``attention_mask=`` for padding.

    Raises:
        PipelineConfigError: a model without a head over a base model, no
            single ModuleList of layers, more stages than the layers can
            fill, bad ``layer_splits``, a MoE
            model with ``output_router_logits=True`` (its router loss spans the
            stages; the returned loss would leave it out), or
            (``verify``) a model whose stages would not compute the whole
            model (a scale or soft cap on logits or embeddings in its
            forward, an extra embedding not added to the tokens', dropout outside the layers).
    """
    names = stage_names_for_causal_lm(model, num_stages=num_stages, layer_splits=layer_splits)
    inp, out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    head, tied_weight, tied = None, None, []
    if len(names) > 1 and callable(inp) and callable(out):
        emb, head = inp(), out()
        if emb is not None and head is not None and getattr(emb, "weight", None) is getattr(head, "weight", 0):
            # tied input and output embeddings on the first and the last stage: shared by the stages built in one
            # process (_CausalLMStageFn.tied), kept equal across ranks by the Pipeline (RuntimeOptions.tied_weights)
            tied_weight = head.weight
            tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is tied_weight]
    cfg = getattr(model, "config", None)
    if getattr(cfg, "output_router_logits", False) and getattr(cfg, "router_aux_loss_coef", 1.0):
        # A MoE model (Mixtral, Qwen2-MoE...) trained by its own loss adds router_aux_loss_coef x a load-balancing
        # loss over the router logits of *every* layer together (not a sum of per-layer terms, so no stage can
        # compute its share); causal_lm_loss and the logits the stages hand on leave it out: another training
        # objective, silently (the routers' gradients differed from model(..., labels=...).loss.backward()).
        raise PipelineConfigError(
            f"{type(model).__name__} has output_router_logits=True: its own loss adds router_aux_loss_coef="
            f"{cfg.router_aux_loss_coef} x the load-balancing loss over every layer's router logits, which span the "
            "stages, and stage_fn_for_causal_lm's loss (the causal-LM cross-entropy) cannot include it; build it with "
            "output_router_logits=False (no load-balancing loss) or router_aux_loss_coef=0, or pipeline it with a "
            "stage_fn and loss of your own"
        )
    aligned = None
    if verify and len(names) > 1:
        layer_list = _layout(model)[1]
        counts = [sum(1 for n in st if n.startswith(layer_list + ".")) for st in names]
        try:
            verify_causal_lm_split(model, counts)
        except PipelineConfigError as refused:
            # a forward that picks each layer's kind by its position in the list may compose with the other stages'
            # layers kept in place as pass-throughs (Gemma 3, Qwen2 with sliding windows): taken only if checked so
            try:
                tuple_output = _verify_aligned(model, counts)
            except PipelineConfigError:
                raise refused from None
            if tuple_output is None:
                raise refused from None
            aligned = (layer_list, [_plain_attrs(m) for m in model.get_submodule(layer_list)], tuple_output)
    if tied_weight is None:
        split = split_by_fqn(model, names, device=device, placeholder="identity", output_field="logits")
    else:
        # split_by_fqn refuses a parameter two stages hold (it cannot share it: each stage is a deep copy); its
        # checks see the head untied, its stages are deep copies of the tied model, each keeping one end
        head.weight = nn.Parameter(torch.empty_like(tied_weight, device="meta"), requires_grad=tied_weight.requires_grad)
        try:
            split = split_by_fqn(model, names, device=device, placeholder="identity", output_field="logits")
        finally:
            head.weight = tied_weight
    return _CausalLMStageFn(split, aligned, tied, _added_embeddings(model, _layout(model)[0])), causal_lm_loss


#: the probe's sizes (attributes of the model's config set where it has them, as ints)
_PROBE_SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "ffn_hidden_size": 96, "n_inner": 96, "rotary_dim": 8,
                "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                # windows shorter than the probe's sequence, so a layer given the wrong attention kind shows
                "sliding_window": 3, "attention_chunk_size": 3}
#: the probe's batch: rows of this many tokens, the last row left-padded by _PROBE_PAD
_PROBE_SEQ, _PROBE_PAD = 10, 3


def _probe_model(model: nn.Module) -> nn.Module:
    """A small float32 CPU model of ``model``'s class and config: the same depth, layer kinds and flags (what its
    forward does around and between the layers depends on them), the widths, expert counts and attention windows
    shrunk, weights drawn so that activations and logits are of order one to a few (a scale or a soft cap applied
    where it should not be shows).  Draws from the global generator (the caller forks it)."""
    cfg = copy.deepcopy(model.config)
    for attr, value in _PROBE_SIZES.items():
        cur = getattr(cfg, attr, None)
        if isinstance(cur, int) and not isinstance(cur, bool) and cur > value:
            try:
                setattr(cfg, attr, value)
            except (AttributeError, TypeError):
                pass
    specials = [getattr(cfg, a, None) for a in ("pad_token_id", "bos_token_id", "eos_token_id")]
    specials = [i for v in specials for i in (v if isinstance(v, list) else [v]) if isinstance(i, int)]
    cfg.vocab_size = max([96, *(i + 1 for i in specials)])
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    probe = type(model)(cfg).float().eval()
    embeddings = {id(m.weight) for m in probe.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, p in probe.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if id(p) in embeddings else 2.0 / p.shape[-1] ** 0.5)
            else:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return probe


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for v in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    return None


class _CountDropout(torch.overrides.TorchFunctionMode):
    """Counts dropouts drawn (``F.dropout`` and kin with p > 0 in training: modules and functional calls alike)."""

    _FUNCS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        #: the draws (``("dropout", p)``) in order, with the decoder layers entered between them (``("layer", i)``,
        #: noted by :func:`_note_layers`' hooks): a dropout moved to another place (before another layer) shows here
        self.events: list[tuple[str, float]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._FUNCS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and float(p) > 0:
                self.calls += 1
                self.events.append(("dropout", float(p)))
        return func(*args, **kwargs)


def _note_layers(layers: nn.Module, into: _CountDropout) -> list[Any]:
    """Hooks noting each real decoder layer of ``layers`` (by its index in the whole model) as it is entered."""
    return [m.register_forward_pre_hook(lambda mod, args, i=int(k): into.events.append(("layer", i)))
            for k, m in layers._modules.items() if m is not None and not isinstance(m, _AbsentLayer)]


def verify_causal_lm_split(model: nn.Module, layers_per_stage: Sequence[int]) -> None:
    """Refuse a split whose stages, chained, would compute something other than the unsplit model.

    Every stage runs the model's own ``forward`` with pass-through placeholders, which is right only if that
    forward maps the hidden states through every module it does not own and does nothing else to them.  Some
    models do more, and the split would then differ silently: a scale or soft cap the causal-LM ``forward`` applies
    to the logits (Cohere's ``logit_scale``, Gemma 2's ``final_logit_softcapping``, Granite's ``logits_scaling``) or
    the base model to the embeddings (Granite's ``embedding_multiplier``) would run on every stage's output; an
    extra embedding used otherwise than added to the token embedding (:class:`_NoEmbedding` on the later stages) would
    differ; a forward that picks each layer's
    attention kind by its position in the layer list (``config.layer_types[i]`` over ``enumerate(self.layers)``:
    Qwen2 with sliding windows, Gemma 3, GPT-OSS) would count from 0 on every stage.  So a small model of the same
    class and config (:func:`_probe_model`: the same depth and layer kinds, widths and attention windows shrunk)
    is split as asked and run whole and as the chained stages on a batch with a padded row, in float32; the hidden
    states entering each stage and the logits must agree to 1e-5 of their scale, else :class:`PipelineConfigError`
    names the first stage boundary that differs.  In training mode the chained stages must draw no more dropouts
    than the whole model (a dropout outside the layers would drop again on every stage).  A small model that cannot
    be built or run warns and leaves the split unchecked.  The caller's random state is left as it was, and the
    check runs on the CPU whatever the caller's default device (the meta device included).

    This checks the plain split (other stages' layers removed).  :func:`stage_fn_for_causal_lm`, where this
    refuses, checks the aligned split too (other stages' layers kept in place as pass-throughs) and takes it if it
    passes, which serves the forwards that pick layer kinds by list position.
    """
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        _verify(model, layers_per_stage)


def _refuse(name: str, what: str) -> PipelineConfigError:
    return PipelineConfigError(
        f"{name} cannot be split by stage_fn_for_causal_lm: {what} (checked on a small {name} of the same config). "
        "Its forward does more than pass hidden states through the modules a stage does not own (a scale or soft cap "
        "on the logits or the embeddings, an extra embedding not added to the tokens', each layer's attention kind "
        "taken from its position in the layer list, ...), so the stages would compute another model. Use "
        "pipeloom.split_by_tracing, or a stage_fn of your own (pipeloom.split_by_fqn with placeholder=None)")


def _verify_aligned(model: nn.Module, layers_per_stage: Sequence[int]) -> bool | None:
    """:func:`verify_causal_lm_split` of the split with the other stages' layers kept in place as pass-throughs;
    returns whether the model's layers return tuples (the pass-throughs return the same), None if it could not run."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        return _verify(model, layers_per_stage, aligned=True)


def _verify(model: nn.Module, layers_per_stage: Sequence[int], aligned: bool = False) -> bool | None:
    """The check (see :func:`verify_causal_lm_split`); whether the layers return tuples, or None where it could not run."""
    counts = [int(c) for c in layers_per_stage]
    name = type(model).__name__

    def unchecked(why: str, exc: BaseException | None = None) -> None:
        detail = f" ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})" if exc is not None else ""
        warnings.warn(f"pipeloom.hf: {why}{detail}; the split of {name} is not checked", RuntimeWarning, stacklevel=4)

    try:
        probe = _probe_model(model)
        layer_list = _layout(probe)[1]
        names = stage_names_for_causal_lm(probe, layer_splits=counts)
    except Exception as exc:  # noqa: BLE001 - the check is a guard, not a requirement: say so
        unchecked(f"could not build a small {name} to check that its stages compose to the whole model", exc)
        return None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, probe.config.vocab_size, (3, _PROBE_SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :_PROBE_PAD] = 0

    # the whole model, with the hidden states entering each layer
    entering: dict[int, torch.Tensor | None] = {}

    def note(i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            entering.setdefault(i, _first_tensor(args, kwargs))
        return hook

    tuple_output: list[bool] = []
    hooks = [lay.register_forward_pre_hook(note(i), with_kwargs=True) for i, lay in enumerate(probe.get_submodule(layer_list))]
    hooks.append(probe.get_submodule(layer_list)[0].register_forward_hook(
        lambda m, a, o: tuple_output.append(isinstance(o, tuple)) if not tuple_output else None))
    try:
        with torch.no_grad():
            whole = reduce_output(probe(ids, attention_mask=mask, use_cache=False), "logits")
    except Exception as exc:  # noqa: BLE001 - the small model itself does not run: nothing to compare with
        unchecked(f"a small {name} built to check that its stages compose to the whole model does not run", exc)
        return None
    finally:
        for hk in hooks:
            hk.remove()
    if not isinstance(whole, torch.Tensor) or not bool(torch.isfinite(whole).all()):
        unchecked(f"a small {name} built to check that its stages compose to the whole model gave logits that are not finite")
        return None
    tup = bool(tuple_output and tuple_output[0])
    split = _CausalLMStageFn(split_by_fqn(probe, names, placeholder="identity", output_field="logits"),
                             (layer_list, [_plain_attrs(m) for m in probe.get_submodule(layer_list)], tup) if aligned else None,
                             added=_added_embeddings(probe, _layout(probe)[0]))

    def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
        if got.shape != want.shape:
            return False, f"shape {tuple(got.shape)} against {tuple(want.shape)}"
        diff = float((got - want).abs().max())
        return diff <= 1e-5 * max(1.0, float(want.abs().max())), f"by up to {diff:.3g}"  # (nan: not close)

    h: Any = ids
    first = 0
    with torch.no_grad():
        for s in range(len(counts)):
            stage = split(s).eval()
            try:
                h = stage(h, attention_mask=mask)
            except Exception as exc:  # noqa: BLE001 - the whole model ran on this input: the split is what fails
                raise _refuse(name, f"stage {s} fails where the whole model runs ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
            del stage
            first += counts[s]
            if s < len(counts) - 1 and first < sum(counts):  # (past the last layer: the logits below tell)
                want = entering.get(first)
                ok, how = close(h, want) if isinstance(want, torch.Tensor) else (False, "no hidden states seen there")
                if not ok:
                    raise _refuse(name, f"stage {s}'s output differs from the hidden states that enter decoder layer "
                                        f"{first} in the whole model ({how})")
    ok, how = close(h, whole)
    if not ok:
        raise _refuse(name, f"the last stage's logits differ from the whole model's ({how})")

    # training mode: the chained stages draw the whole model's dropouts, no more, at the same places (between the
    # same decoder layers: a dropout module outside the layers kept on every stage draws again on each; one put on
    # the stage of its side by registration order may be called elsewhere in the forward)
    with _CountDropout() as whole_drops:
        hooks = _note_layers(probe.get_submodule(layer_list), whole_drops)
        try:
            with torch.no_grad():
                probe.train()(ids, attention_mask=mask, use_cache=False)
        finally:
            for hk in hooks:
                hk.remove()
    h = ids
    with _CountDropout() as split_drops:
        for s in range(len(counts)):
            stage = split(s).train()
            hooks = _note_layers(stage.get_submodule(layer_list), split_drops)
            with torch.no_grad():
                h = stage(h, attention_mask=mask)
            del stage, hooks
    if split_drops.calls > whole_drops.calls:
        raise _refuse(name, f"in training the stages draw {split_drops.calls} dropouts where the whole model draws "
                            f"{whole_drops.calls} (a dropout outside the decoder layers runs on every stage; set its "
                            "probability to 0 in the config, or split another way)")
    if split_drops.events != whole_drops.events:
        where = next(i for i, (a, b) in enumerate(zip(split_drops.events + [None], whole_drops.events + [None])) if a != b)
        before = [e for e in whole_drops.events[:where] if e[0] == "layer"]
        at = f"after decoder layer {before[-1][1]}" if before else "before the first decoder layer"
        raise _refuse(name, f"in training the stages draw the whole model's dropouts at other places (the first "
                            f"difference {at}: a dropout outside the decoder layers placed on another stage than where "
                            "the forward calls it; set its probability to 0 in the config, or split another way)")
    return tup
