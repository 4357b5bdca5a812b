"""pipeloom.hf: Hugging Face causal LMs pipelined through their own forward.

Real ``transformers`` models (Llama, Qwen2, Mistral), random-initialised from
tiny configs in float64, nothing downloaded.  In one process: the stages a
split gives, chained, equal the unsplit model (logits and gradients, with a
padding mask), keep Hugging Face's parameter names (a full state dict loads
into every stage), and bad splits are refused.  On real gloo ranks: one
``Pipeline.step`` gives the unsplit model's gradients and losses for every
schedule on 2 ranks (Llama), a subset on 4 ranks, and Qwen2/Mistral.
Torch's tracer on Llama: the failed capture names DynamicCache and its fix,
and the traced split's skip edges (mask, cos, sin) are routed.

``transformers`` is the ``hf`` extra (``.ci/run`` installs it); the module
is skipped only where it is not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402
from hf_worker import build_hf_model, make_hf_batch  # noqa: E402

from pipeloom import PipelineConfigError  # noqa: E402
from pipeloom.hf import causal_lm_loss, stage_fn_for_causal_lm, stage_names_for_causal_lm  # noqa: E402
from pipeloom.schedules import SCHEDULE_NAMES  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-12)


def _chain(stages: list[torch.nn.Module], ids: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
    h = ids
    for st in stages:
        h = st(h, **kw)
    return h


def _assert_stages_are_the_model(model: torch.nn.Module, stages: list[torch.nn.Module], loss_fn: Any, ids: torch.Tensor,
                                 labels: torch.Tensor, mask: torch.Tensor | None) -> None:
    """The chained stages' logits and every parameter's gradient (under its Hugging Face name) equal the model's."""
    ref = model(ids, attention_mask=mask, use_cache=False).logits
    causal_lm_loss(ref, labels).backward()
    out = _chain(stages, ids, attention_mask=mask)
    loss_fn(out, labels).backward()
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, ref, **TOL)
    got = {n: p.grad for st in stages for n, p in st.named_parameters()}
    assert got.keys() == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize(("family", "num_stages"), [("llama", 2), ("llama", 8), ("qwen2", 4), ("mistral", 3)])
def test_stages_compose_to_the_hf_model(family: str, num_stages: int) -> None:
    model = build_hf_model(family)
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=num_stages)
    _assert_stages_are_the_model(model, [stage_fn(i) for i in range(num_stages)], loss_fn, *make_hf_batch(padding=True))


def test_split_layout_names_and_state_dict() -> None:
    model = build_hf_model("llama")  # 6 layers
    names = stage_names_for_causal_lm(model, num_stages=4)
    assert names == [
        ["model.embed_tokens", "model.layers.0"],
        ["model.layers.1", "model.layers.2"],
        ["model.layers.3", "model.layers.4"],
        ["model.layers.5", "model.norm", "lm_head"],
    ]
    assert stage_names_for_causal_lm(model, layer_splits=[0, 6, 0])[1] == [f"model.layers.{i}" for i in range(6)]
    stage_fn, _ = stage_fn_for_causal_lm(model, num_stages=4)
    full = model.state_dict()
    for i in range(4):
        st = stage_fn(i)
        # Hugging Face's names: the full state dict loads by name, strictly.
        st.load_state_dict({k: full[k] for k in st.state_dict()}, strict=True)
        assert "model.rotary_emb.inv_freq" in dict(st.named_buffers())  # buffer-only: copied to every stage
    middle = stage_fn(1)
    assert type(middle).__name__ == "LlamaForCausalLM"
    assert [n for n, _ in middle.model.layers.named_children()] == ["1", "2"]
    assert "PassThrough" in repr(middle.lm_head) and "stage 3" in repr(middle.lm_head)


def test_plain_split_by_fqn_runs_an_hf_model() -> None:
    """The issue's first try, now working: split_by_fqn alone, no adapter."""
    from pipeloom import split_by_fqn

    model = build_hf_model("qwen2")
    stage_fn = split_by_fqn(model, stage_names_for_causal_lm(model, num_stages=3))
    assert stage_fn.placeholder == "identity"  # type: ignore[attr-defined]  # "auto" on a transformers model
    ids, _, _ = make_hf_batch()
    out = _chain([stage_fn(i) for i in range(3)], ids)  # later stages get hidden states as input_ids
    # Stages 0 and 1 handed on their ModelOutput's first tensor; the last returns its ModelOutput.
    torch.testing.assert_close(out.logits, model(ids, use_cache=False).logits, **TOL)


def test_meta_device_hf_model_is_materialised_by_its_init_weights() -> None:
    import transformers

    cfg = build_hf_model("llama").config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    stage_fn, _ = stage_fn_for_causal_lm(model, num_stages=2, device="cpu")
    s0, s1 = stage_fn(0), stage_fn(1)
    assert not any(t.is_meta for st in (s0, s1) for t in (*st.parameters(), *st.buffers()))
    # Hugging Face's init_weights recomputes the rotary table (a non-persistent buffer).
    want = transformers.LlamaForCausalLM(cfg).model.rotary_emb.inv_freq
    torch.testing.assert_close(s1.model.rotary_emb.inv_freq, want)
    ids, _, _ = make_hf_batch()
    assert torch.isfinite(s1(s0(ids))).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_stages=9), r"stage 7 of 9 would hold no decoder layer.*at most 8 stages"),
        (dict(layer_splits=[3, 2]), r"summing to the model's 6 decoder layers"),
        (dict(num_stages=3, layer_splits=[3, 3]), r"num_stages=3 but layer_splits has 2"),
        (dict(), r"give num_stages"),
    ],
)
def test_bad_splits_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        stage_fn_for_causal_lm(build_hf_model("llama"), **kwargs)


def test_tied_embeddings_across_stages_are_one_parameter_per_process() -> None:
    """Tied input and output embeddings on the first and the last stage: the stages built in one process share one
    parameter (held by the stage function's TiedEmbeddings, where the Pipeline finds the tie across ranks and keeps
    the copies equal: tests/test_tied_sync.py), equal to the model's; the model itself is left as it was."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    weight = model.lm_head.weight
    assert weight is model.model.embed_tokens.weight
    stage_fn, _ = stage_fn_for_causal_lm(model, num_stages=2)
    assert model.lm_head.weight is weight and model.model.embed_tokens.weight is weight  # (untouched)
    first, last = stage_fn(0), stage_fn(1)
    shared = first.model.embed_tokens.weight
    assert shared is last.lm_head.weight and shared is not weight and torch.equal(shared, weight)
    assert dict(stage_fn.tied.named_parameters(remove_duplicate=False)) == {"model.embed_tokens.weight": shared,
                                                                             "lm_head.weight": shared}
    stage_fn_for_causal_lm(model, num_stages=1)  # one stage holds both: fine


def _tiny_config(config_cls: str, **extra: Any) -> Any:
    """The config of :func:`_tiny`'s models."""
    import transformers

    kw: dict[str, Any] = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return getattr(transformers, config_cls)(**{**kw, **extra})


def _tiny(config_cls: str, model_cls: str, **extra: Any) -> torch.nn.Module:
    """A tiny float64 model of any transformers family (the config's own defaults beside the sizes)."""
    import transformers

    cfg = _tiny_config(config_cls, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).to(torch.float64)


@pytest.mark.parametrize(("config_cls", "model_cls", "extra", "splits", "match"), [
    # the causal LM's forward scales the logits (every stage's output, hidden states on all but the last)
    ("CohereConfig", "CohereForCausalLM", {}, [2, 2], r"stage 0's output differs from the hidden states that enter decoder layer 2 "),
    # a soft cap on the logits
    ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 4}, [2, 2], r"stage 0's output differs"),
    # the embeddings scaled in the base model's forward, the logits in the causal LM's
    ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}, [2, 2], r"stage 0's output differs"),
    # an embedding dropout drawn functionally in the base model's forward (no module): again on every stage
    ("Starcoder2Config", "Starcoder2ForCausalLM", {"embedding_dropout": 0.3}, [2, 2],
     r"in training the stages draw 2 dropouts where the whole model draws 1"),
])
def test_models_whose_stages_would_compute_another_model_are_refused(config_cls: str, model_cls: str, extra: dict,
                                                                     splits: list[int], match: str) -> None:
    """Every stage runs the model's own forward with pass-throughs: right only where that forward does nothing to
    the hidden states but the modules' work.  These do more; split unchecked, the chained stages compute another
    model, silently (verify=False shows it: another output, or in training another dropout draw); checked, the split
    is refused, naming the first boundary that differs."""
    import transformers

    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    model = _tiny(config_cls, model_cls, **extra).eval()
    with pytest.raises(PipelineConfigError, match=rf"{model_cls} cannot be split by stage_fn_for_causal_lm: {match}"):
        stage_fn_for_causal_lm(model, layer_splits=splits)
    stage_fn, _ = stage_fn_for_causal_lm(model, layer_splits=splits, verify=False)
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    whole = model(ids, use_cache=False).logits
    if "dropout" in match:
        return  # (evaluation composes; the extra draw in training is what the check counted)
    out = _chain([stage_fn(i) for i in range(len(splits))], ids)
    assert not torch.allclose(out, whole, **TOL)  # what the check prevents: another model, silently


@pytest.mark.parametrize(("config_cls", "model_cls", "extra"), [
    ("OlmoConfig", "OlmoForCausalLM", {}),  # its final norm has no weights: on the last stage only (the plan lists it)
    ("PhiConfig", "PhiForCausalLM", {"embd_pdrop": 0.3}),  # embedding dropout: on the first stage only (ditto)
    ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 4}),
    ("GraniteConfig", "GraniteForCausalLM", {}),  # its multipliers at 1: nothing to apply twice
    # a position embedding added to the token embedding (on the later stages it adds nothing: it was refused, the
    # pass-through there adding the position ids) and an embedding dropout the base model holds, unlisted (no
    # plan): on stage 0 only (it was kept on every stage, drawn once per stage in training)
    ("GPT2Config", "GPT2LMHeadModel", {"embd_pdrop": 0.3}),
])
def test_other_families_compose_exactly(config_cls: str, model_cls: str, extra: dict) -> None:
    """Families beyond the gradient pool's three, accepted by the check: chained stages equal the whole model
    (logits, every parameter's gradient); Phi with embedding dropout in training draws it once, on stage 0."""
    model = _tiny(config_cls, model_cls, **extra).eval()  # (dropout off for the comparison; on below)
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=3)
    stages = [stage_fn(i) for i in range(3)]
    ids, labels, mask = make_hf_batch(padding=True)
    _assert_stages_are_the_model(model, stages, loss_fn, ids, labels, mask)
    if extra.get("embd_pdrop"):
        calls = []
        for st in stages:
            st.train()
            for name, m in st.named_modules():
                if isinstance(m, torch.nn.Dropout) and m.p > 0 and ".layers." not in name and ".h." not in name:
                    m.register_forward_hook(lambda mod, a, o, name=name: calls.append(name))
        _chain(stages, ids)
        assert calls == [{"PhiConfig": "model.embed_dropout", "GPT2Config": "transformer.drop"}[config_cls]]


@pytest.mark.parametrize(("config_cls", "model_cls", "extra", "splits"), [
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 4, "num_hidden_layers": 12, "sliding_window": 3}, [4, 4, 4]),
    ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}, [1, 3]),
])
def test_layer_kinds_by_list_position_compose_with_the_other_layers_kept_in_place(config_cls: str, model_cls: str,
                                                                                extra: dict, splits: list[int]) -> None:
    """Forwards that pick each layer's attention kind (sliding or full window) by its position in the layer list,
    ``config.layer_types[i]`` over ``enumerate(self.layers)``: with the other stages' layers removed a stage counts
    from 0 and gives its layers the wrong windows (verify=False shows the chained stages differ); the check finds
    it, and the split keeps the other stages' layers in place as pass-throughs, which composes exactly (logits and
    every gradient, float64, a padded row, sequences past the window)."""
    model = _tiny(config_cls, model_cls, **extra).eval()
    ids = torch.randint(3, 40, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    plain, _ = stage_fn_for_causal_lm(model, layer_splits=splits, verify=False)
    assert plain.aligned is None  # type: ignore[attr-defined]
    with torch.no_grad():
        assert not torch.allclose(_chain([plain(i) for i in range(len(splits))], ids, attention_mask=mask),
                                  model(ids, attention_mask=mask, use_cache=False).logits, **TOL)
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, layer_splits=splits)
    assert stage_fn.aligned is not None  # type: ignore[attr-defined]
    # (every gradient under its name: the pass-throughs hold nothing)
    stages = [stage_fn(i) for i in range(len(splits))]
    _assert_stages_are_the_model(model, stages, loss_fn, ids, labels, mask)
    absent = stages[0].model.layers[splits[0]]  # (a layer of stage 1, as stage 0 holds it)
    assert "on another pipeline stage" in repr(absent)
    with pytest.raises(AttributeError, match=rf"decoder layer {splits[0]} is on another pipeline stage.*'self_attn'"):
        absent.self_attn


def _qwen2_with_tuple_layers(**extra: Any) -> torch.nn.Module:
    """A tiny float64 Qwen2 in the transformers 4.x style, built from the installed 5.x classes: each decoder layer
    returns a tuple ``(hidden_states,)`` and the base model takes ``[0]`` of it (4.x's ``layer_outputs[0]``); the
    rest is Qwen2's own (its config and ``base_model_pp_plan``, attention kinds by list position,
    ``config.layer_types[i]``), so ``stage_fn_for_causal_lm`` treats it as Qwen2."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    class TupleQwen2DecoderLayer(qwen2.Qwen2DecoderLayer):
        def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
            return (super().forward(*args, **kwargs),)

    class TupleQwen2Model(qwen2.Qwen2Model):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.layers = torch.nn.ModuleList(TupleQwen2DecoderLayer(config, i) for i in range(config.num_hidden_layers))

        def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, cache: Any = None,
                    inputs_embeds: Any = None, use_cache: Any = None, **kwargs: Any) -> Any:
            # transformers 5.24's Qwen2Model.forward (its decorators left out), but for the [0] on each layer's output
            if (input_ids is None) ^ (inputs_embeds is not None):
                raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            if use_cache and cache is None:
                cache = DynamicCache(config=self.config)
            if position_ids is None:
                past_seen_tokens = cache.get_seq_length() if cache is not None else 0
                position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens).unsqueeze(0)
            if not isinstance(causal_mask_mapping := attention_mask, dict):
                mask_kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                               "cache": cache, "position_ids": position_ids}
                causal_mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
                if self.has_sliding_layers:
                    causal_mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
            hidden_states = inputs_embeds
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
            for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
                hidden_states = decoder_layer(
                    hidden_states, attention_mask=causal_mask_mapping[self.config.layer_types[i]],
                    position_embeddings=position_embeddings, position_ids=position_ids, cache=cache, use_cache=use_cache,
                    **kwargs,
                )[0]  # (the 4.x style)
            hidden_states = self.norm(hidden_states)
            return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)

    class TupleQwen2ForCausalLM(qwen2.Qwen2ForCausalLM):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = TupleQwen2Model(config)

    cfg = _tiny_config("Qwen2Config", **extra)
    torch.manual_seed(0)
    return TupleQwen2ForCausalLM(cfg).to(torch.float64)


def test_the_aligned_split_of_a_model_whose_layers_return_tuples_passes_tuples(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4.x decoder layers return ``(hidden_states, ...)`` and the model's forward takes ``[0]``; the
    aligned split's pass-throughs must return the same (they are told so by the check, which watches the small
    model's first layer).  On a Qwen2 made in that style: the aligned split is taken, with tuples; its pass-throughs
    return ``(hidden_states,)``; the chained stages equal the model exactly (logits, every gradient, float64, a padded
    row, a sequence past the window); and the same stages with pass-throughs that return the bare tensor do not."""
    from pipeloom.hf import _AbsentLayer

    model = _qwen2_with_tuple_layers(use_sliding_window=True, sliding_window=3, max_window_layers=2).eval()
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    ids = torch.randint(3, 40, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    outputs: list[Any] = []
    hook = model.model.layers[0].register_forward_hook(lambda m, a, o: outputs.append(o))
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)
    hook.remove()
    assert isinstance(outputs[0], tuple) and len(outputs[0]) == 1  # (the style, for real)
    splits = [1, 2, 1]  # (the middle stage has pass-throughs on both sides)
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, layer_splits=splits)
    assert stage_fn.aligned is not None  # type: ignore[attr-defined]
    layer_list, attrs, tuple_output = stage_fn.aligned  # type: ignore[attr-defined]
    assert (layer_list, len(attrs), tuple_output) == ("model.layers", 4, True)
    stages = [stage_fn(i) for i in range(len(splits))]
    kinds = [[type(lay).__name__ for lay in st.model.layers] for st in stages]
    assert kinds == [["TupleQwen2DecoderLayer", "_AbsentLayer", "_AbsentLayer", "_AbsentLayer"],
                     ["_AbsentLayer", "TupleQwen2DecoderLayer", "TupleQwen2DecoderLayer", "_AbsentLayer"],
                     ["_AbsentLayer", "_AbsentLayer", "_AbsentLayer", "TupleQwen2DecoderLayer"]]
    h = torch.randn(3, 10, 16, dtype=torch.float64)
    for got in (stages[1].model.layers[3](h, attention_mask=None), stages[1].model.layers[0](hidden_states=h)):
        assert isinstance(got, tuple) and len(got) == 1 and got[0] is h
    _assert_stages_are_the_model(model, stages, loss_fn, ids, labels, mask)

    # the control: the same split with pass-throughs that return the bare tensor, as for 5.x layers, is another model:
    # the forward's [0] takes the first batch row of what a pass-through returns (then that row's first token, ...),
    # and on stage 0, after three pass-throughs, the head is handed a 0-d tensor
    assert _AbsentLayer(1, {}, tuple_output=False)(h) is h
    monkeypatch.setattr(stage_fn, "aligned", (layer_list, attrs, False))
    bare = [stage_fn(i) for i in range(len(splits))]
    assert [type(lay).__name__ for st in bare for lay in st.model.layers] == sum(kinds, [])
    assert stages[0].model.layers[1](h)[0] is h and bare[0].model.layers[1](h)[0].shape == (10, 16)
    with torch.no_grad(), pytest.raises(IndexError, match="too many indices for tensor of dimension 0"):
        _chain(bare, ids, attention_mask=mask)


def test_a_dropout_outside_the_layers_on_every_stage_is_refused() -> None:
    """A base model that drops its embeddings with a module the plan does not list, registered after the layers: in
    evaluation the stages compose, but in training it would drop again on every stage (kept on each), or, put on the
    last stage by its registration order, drop the hidden states entering the last stage instead of the embeddings
    (one draw each way: a count alone passes it); refused, by where the draws fall between the decoder layers."""
    import transformers

    class DropModel(transformers.LlamaModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.extra_drop = torch.nn.Dropout(0.5)

        def forward(self, input_ids: Any = None, inputs_embeds: Any = None, **kw: Any) -> Any:
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            return super().forward(inputs_embeds=self.extra_drop(inputs_embeds), **kw)

    class DropLM(transformers.LlamaForCausalLM):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = DropModel(config)

    model = DropLM(_tiny("LlamaConfig", "LlamaForCausalLM").config)
    with pytest.raises(PipelineConfigError, match=r"in training the stages draw the whole model's dropouts at other "
                                                  r"places \(the first difference before the first decoder layer"):
        stage_fn_for_causal_lm(model, num_stages=2)


def test_the_check_leaves_the_random_state_and_warns_when_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeloom.hf

    model = build_hf_model("llama")
    state = torch.get_rng_state()
    stage_fn_for_causal_lm(model, num_stages=2)
    assert torch.equal(torch.get_rng_state(), state)
    for _ in range(3):  # (called under the meta device: the check still runs on the CPU, on real numbers)
        with torch.device("meta"):
            stage_fn_for_causal_lm(model, num_stages=3)

    def unbuildable(model: Any) -> Any:
        raise ValueError("a config the small model cannot be built from")

    monkeypatch.setattr(pipeloom.hf, "_probe_model", unbuildable)
    with pytest.warns(RuntimeWarning, match=r"could not build a small LlamaForCausalLM .*ValueError: a config.*the split of LlamaForCausalLM is not checked"):
        stage_fn_for_causal_lm(model, num_stages=2)


def test_labels_go_to_the_loss_not_the_stages() -> None:
    stage_fn, _ = stage_fn_for_causal_lm(build_hf_model("llama"), num_stages=2)
    ids, labels, _ = make_hf_batch()
    with pytest.raises(PipelineConfigError, match="target=labels"):
        stage_fn(0)(ids, labels=labels)


def test_causal_lm_loss_shifts_and_ignores_padding() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=g)
    labels = torch.tensor([[1, 2, 3, 4, 5], [-100, -100, 6, 0, 1]])
    want = torch.nn.functional.cross_entropy(
        torch.cat([logits[0, :4], logits[1, 1:4]]), torch.tensor([2, 3, 4, 5, 6, 0, 1])
    )
    got = causal_lm_loss(logits, labels)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"logits \(batch, seq, vocab\)"):
        causal_lm_loss(logits[0], labels)


# ---------------------------------------------------------------- torch's tracer on an HF model


def test_tracing_hf_names_the_cache_and_routes_skip_edges() -> None:
    from torch.distributed.pipelining import SplitPoint

    from pipeloom import split_by_tracing

    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("torch's pipeline() cannot split a transformers 4.x Llama (AttributeError in its splitter)")
    model = build_hf_model("llama", layers=4)
    ids, _, _ = make_hf_batch(batch=2)
    spec = {f"model.layers.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)}
    with pytest.raises(PipelineConfigError, match=r"DynamicCache(.|\n)*Fix: .*use_cache=False") as info:
        split_by_tracing(model, example_args=(ids,), split_spec=spec)
    assert "cannot capture your model" in str(info.value.__cause__)  # torch's own error, chained
    stage_fn = split_by_tracing(model, example_args=(ids,), example_kwargs={"use_cache": False}, split_spec=spec)
    # Stage 0 computes the causal mask and cos/sin; stages 1..3 read them: carried through 1 and 2.
    assert len(stage_fn.skip_edges) == 6 and all("of stage 0) carried through stage" in e for e in stage_fn.skip_edges)
    stages = [stage_fn(i) for i in range(4)]
    h: tuple = (ids,)
    for st in stages:
        out = st(*h)
        h = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(h[0], model(ids, use_cache=False).logits, **TOL)
    assert [n for n, _ in stages[2].named_parameters()][0] == "model.layers.2.input_layernorm.weight"


# ---------------------------------------------------------------- real ranks

CASES_2 = [dict(id=f"llama-{s}", family="llama", schedule=s, microbatches=4) for s in SCHEDULE_NAMES] + [
    dict(id="qwen2-ZBV", family="qwen2", schedule="ZBVZeroBubble", microbatches=4),
    dict(id="mistral-Interleaved1F1B", family="mistral", schedule="Interleaved1F1B", microbatches=4, padding=True),
    dict(id="gemma3-1F1B", family="gemma3", schedule="1F1B", microbatches=4, padding=True),
]
CASES_4 = [
    dict(id="llama-1F1B", family="llama", schedule="1F1B", microbatches=8),
    dict(id="llama-ZBVZeroBubble", family="llama", schedule="ZBVZeroBubble", microbatches=8, padding=True),
    dict(id="llama-DualPipeV", family="llama", schedule="DualPipeV", microbatches=8),
    dict(id="qwen2-InterleavedZeroBubble", family="qwen2", schedule="InterleavedZeroBubble", microbatches=8),
]


def _reference(case: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = build_hf_model(case["family"])
    ids, labels, mask = make_hf_batch(padding=case.get("padding", False))
    n = case["microbatches"]
    losses = []
    masks = mask.tensor_split(n) if mask is not None else [None] * n
    for xm, ym, am in zip(ids.tensor_split(n), labels.tensor_split(n), masks):
        loss = causal_lm_loss(model(xm, attention_mask=am, use_cache=False).logits, ym)
        (loss / n).backward()
        losses.append(loss.detach())
    return {k: p.grad for k, p in model.named_parameters()}, torch.stack(losses)


@pytest.mark.parametrize(("world", "cases"), [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
async def test_pipeline_over_hf_model_matches_unsplit(tmp_path: Path, world: int, cases: list[dict]) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path), "cases": cases}))
    worker = Path(__file__).parent / "ranks" / "hf_worker.py"
    codes, _, errs = await spawn_ranks(world, [str(worker), str(job)], timeout=240)
    assert codes == [0] * world, "\n".join(f"--- rank {r} ---\n{e[-3000:]}" for r, e in enumerate(errs))
    for case in cases:
        want, want_losses = _reference(case)
        ranks = [torch.load(tmp_path / f"{case['id']}-rank{r}.pt") for r in range(world)]
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            assert got.keys().isdisjoint(r["params"]), case["id"]
            got.update(r["grads"])
        assert got.keys() == want.keys(), case["id"]
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, **TOL, msg=lambda m, k=name: f"{case['id']} {k}: {m}")
        (last,) = [r for r in ranks if r["last"]]
        torch.testing.assert_close(torch.stack(last["losses"]), want_losses, **TOL)


# ---------------------------------------------------------------- the example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_hf.py"


def test_train_hf_example_trains_and_reloads_into_a_fresh_hf_model(tmp_path: Path) -> None:
    import re
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2", str(EXAMPLE),
         "--schedule", "ZBVZeroBubble", "--steps", "30", "--save", str(tmp_path)],
        cwd=EXAMPLE.parents[1], capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    found = re.search(r"final: first_loss=(?P<first>[0-9.]+) last_loss=(?P<last>[0-9.]+)", proc.stdout)
    assert found, proc.stdout[-3000:]
    assert float(found["last"]) < float(found["first"]) - 0.5, found.group(0)
    reloaded = re.search(r"reloaded: (?P<n>\d+) tensors into a fresh LlamaForCausalLM; its held-out loss (?P<loss>[0-9.]+)", proc.stdout)
    assert reloaded, proc.stdout[-3000:]
    assert float(reloaded["loss"]) < float(found["first"]) - 0.5  # the trained weights, not a fresh init
