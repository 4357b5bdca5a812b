"""Splitting whole models into stages, adversarially: ``pipeloom.hf``, ``split_by_fqn``, the traced split and
``verify_split``, against the unsplit model (float64, tight tolerances), or a clear refusal.

On 2 real gloo ranks (one job, ``tests/ranks/split_adv_worker.py``), one ``Pipeline.step`` of tiny random Hugging
Face models gives the unsplit model's gradients and losses under 1F1B, Interleaved1F1B, ZBVZeroBubble and
DualPipeV: left padding with sdpa; eager attention with config flags that change the output
(``output_hidden_states``, ``output_attentions``, ``use_cache=True``); HF gradient checkpointing, reentrant (the
I/W split falls back to a full backward at I) and not; attention dropout with checkpointing (the recomputation
draws the forward's masks: equal to the same pipeline without checkpointing); dynamic RoPE scaling past
``max_position_embeddings`` (the rotary module, copied to every stage, updates its buffer on each); Mixtral and
Qwen2-MoE without the router loss; a split traced by torch inside the pipeline with an attention mask.

In one process: tied embeddings, MoE router losses, ModelOutputs whose first field is a loss, splits inside a
decoder block (traced: exact; by names: caught by ``verify_split``), buffers shared by every stage, and attempts
to fool ``verify_split``.

Silent bugs these rows found (regression tests now):
- ``stage_fn_for_causal_lm`` on a MoE model with ``output_router_logits=True`` (Mixtral, Qwen2-MoE) trained the
  cross-entropy alone, while the model's own loss adds ``router_aux_loss_coef`` x a load-balancing loss over every
  layer's routers (which span stages): the routers' gradients were another model's.  Now refused with the fix.
- ``verify_split`` held every tensor to at least 1e-5 *absolute* (its scale was floored at 1): gradients of order
  1e-4 (a large vocabulary's head, a scaled loss) could be 10 times too small and pass.  Each tensor is now held to
  its own size.
- ``verify_split`` of a traced split (``split_by_tracing`` / ``stage_fn_from_pipe``) with a keyword input or a skip
  edge refused the correct split ("forward() missing 3 required positional arguments", blamed on split_by_fqn's
  contract): its deep copy of a ``torch.fx.GraphModule`` dropped the routing hooks.  (A false refusal, not a silent
  pass, but it made the check useless for traced splits.)
- (loud but unclear) a ``split_by_fqn`` stage whose ModelOutput lists a scalar before the hidden states
  (``aux_loss`` of a MoE with router logits, ``loss`` with ``labels`` on every stage) handed the scalar on; the next
  stage failed with an IndexError deep inside.  Now a ``TypeError`` naming the stage, the field and the fix.

About 25 s on 2 CPU cores (most of it the rank job).
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402

from pipeloom import PipelineConfigError, split_by_fqn, split_by_tracing, verify_split  # noqa: E402
from pipeloom.hf import causal_lm_loss, stage_fn_for_causal_lm, stage_names_for_causal_lm  # noqa: E402

VOCAB = 40
TOL = dict(rtol=1e-9, atol=1e-12)
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}),
}


def tiny(cfg: str = "LlamaConfig", cls: str = "LlamaForCausalLM", **extra: Any) -> nn.Module:
    kw: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return getattr(transformers, cls)(getattr(transformers, cfg)(**{**kw, **extra})).double().eval()


def tiny_moe(family: str, **extra: Any) -> nn.Module:
    cfg, cls, kw = MOE[family]
    return tiny(cfg, cls, experts_implementation="eager", **kw, **extra)  # (grouped_mm has no float64)


def ids_and_mask(rows: int = 3, seq: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


# ---------------------------------------------------------------- 2 gloo ranks, one job

CASES = [
    dict(id="leftpad-sdpa-ZBV", schedule="ZBVZeroBubble", pad=True, config={"attn_implementation": "sdpa"}),
    dict(id="eager-flags-DualPipeV", schedule="DualPipeV",
         config={"attn_implementation": "eager", "output_hidden_states": True, "output_attentions": True, "use_cache": True}),
    dict(id="ckpt-reentrant-ZBV", schedule="ZBVZeroBubble", pad=True, ckpt="reentrant"),
    dict(id="ckpt-Interleaved1F1B", schedule="Interleaved1F1B", pad=True, ckpt="nonreentrant"),
    dict(id="dropout-ckpt-DualPipeV", schedule="DualPipeV", ckpt="nonreentrant", compare="self", deterministic=True,
         config={"attention_dropout": 0.3}),
    dict(id="rope-dynamic-1F1B", schedule="1F1B", seq=12,
         config={"max_position_embeddings": 8, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    dict(id="mixtral-1F1B", schedule="1F1B", cfg="MixtralConfig", cls="MixtralForCausalLM",
         config={**MOE["mixtral"][2], "experts_implementation": "eager"}),
    dict(id="qwen2moe-ZBV", schedule="ZBVZeroBubble", pad=True, cfg="Qwen2MoeConfig", cls="Qwen2MoeForCausalLM",
         config={**MOE["qwen2moe"][2], "experts_implementation": "eager"}),
    dict(id="traced-mask-1F1B", schedule="1F1B", pad=True, traced=True),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("split_adv")
    (out / "job.json").write_text(json.dumps({"out": str(out), "cases": CASES}))
    worker = Path(__file__).parent / "ranks" / "split_adv_worker.py"
    codes, _, errs = asyncio.run(spawn_ranks(2, [str(worker), str(out / "job.json")], timeout=240))
    assert codes == [0, 0], "\n".join(f"--- rank {r} ---\n{e[-3000:]}" for r, e in enumerate(errs))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_pipelined_hf_model_matches_unsplit(ranks: list[dict[str, Any]], case: dict[str, Any]) -> None:
    rows = [r[case["id"]] for r in ranks]
    assert sum(r["params"] for r in rows) == len(dict(tiny_params(case))), rows  # every parameter, once
    for r in rows:
        assert r["none"] == [], (case["id"], r)
        assert r["grad"] <= 1e-9, (case["id"], r)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 1 and losses[0] <= 1e-10, (case["id"], rows)
    if case.get("ckpt") == "reentrant":  # really checkpointed: the I/W split saw the reentrant region
        assert any("reentrant" in n for r in rows for n in r["notes"]), rows
    if case.get("compare") == "self":  # dropout really drew: far from the model without it
        assert all(r["vs_no_dropout"] > 1e-3 for r in rows), rows


def tiny_params(case: dict[str, Any]) -> Any:
    cfg = case.get("config", {})
    return tiny(case.get("cfg", "LlamaConfig"), case.get("cls", "LlamaForCausalLM"), **cfg).named_parameters()


# ---------------------------------------------------------------- in one process


def test_tied_embeddings_across_first_and_last_stage_are_refused_by_split_by_fqn() -> None:
    """split_by_fqn cannot share a parameter between its stages (each is a deep copy): refused.  stage_fn_for_causal_lm
    shares them (tests/test_hf.py, tests/test_tied_sync.py)."""
    model = tiny(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    stage_fn_for_causal_lm(model, num_stages=2)
    names = stage_names_for_causal_lm(model, num_stages=2)
    with pytest.raises(PipelineConfigError, match=r"'model\.embed_tokens\.weight' on stage 0, 'lm_head\.weight' on stage 1"):
        split_by_fqn(model, names)


@pytest.mark.parametrize("family", sorted(MOE))
def test_a_moe_router_loss_that_spans_stages_is_refused(family: str) -> None:
    """Mixtral / Qwen2-MoE with ``output_router_logits=True``: the model's own loss adds the load-balancing loss
    over every layer's router logits; stage_fn_for_causal_lm's loss is the cross-entropy alone (bug: accepted,
    the routers trained on another objective).  Without router logits the split is exact (the rank rows)."""
    model = tiny_moe(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids, mask = ids_and_mask()
    full = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    # not vacuous: the model's loss is not the causal-LM loss the pipeline would train
    assert abs(float(full.loss) - float(causal_lm_loss(full.logits, ids))) > 0.1
    with pytest.raises(PipelineConfigError, match=r"output_router_logits=True: its own loss adds router_aux_loss_coef=0\.5.*"
                                                   r"build it with output_router_logits=False"):
        stage_fn_for_causal_lm(model, num_stages=2)
    stage_fn_for_causal_lm(tiny_moe(family, output_router_logits=True, router_aux_loss_coef=0.0), num_stages=2)  # nothing added


def test_a_scalar_first_field_is_not_handed_on_as_hidden_states() -> None:
    """split_by_fqn alone on a MoE with router logits: its ModelOutput lists ``aux_loss`` before ``logits``; the
    stage handed the scalar on (the next stage failed with an IndexError inside).  Refused naming the field and
    the fix; with ``output_field='logits'`` the split composes."""
    model = tiny_moe("mixtral", output_router_logits=True)
    ids, mask = ids_and_mask()
    names = stage_names_for_causal_lm(model, num_stages=2)
    with pytest.raises(TypeError, match=r"stage 0 returned a MoeCausalLMOutputWithPast whose first tensor field, 'aux_loss', "
                                        r"is a scalar.*output_field='logits'"):
        split_by_fqn(model, names)(0)(ids, attention_mask=mask)
    verify_split(model, split_by_fqn(model, names, output_field="logits"), ids, attention_mask=mask, use_cache=False,
                 target=ids, loss_fn=causal_lm_loss, rtol=1e-9)


#: inside a decoder block, after a module with two outputs (the attention) and at a block: 4 stages, so the mask and
#: cos/sin computed on stage 0 are carried through stages 1 and 2 (skip edges)
TRACED_SPEC = {"model.layers.1.mlp": "BEGINNING", "model.layers.2.self_attn": "END", "model.layers.3": "BEGINNING"}


def test_verify_split_checks_traced_splits() -> None:
    """Traced splits inside a block and with skip edges (the mask and cos/sin carried through stages) compose
    exactly, with a padding mask given by name; verify_split used to refuse them all (bug: its deep copy of the
    traced GraphModules dropped their routing hooks)."""
    from torch.distributed.pipelining import SplitPoint

    model = tiny()
    ids, mask = ids_and_mask()
    stage_fn = split_by_tracing(model, example_args=(ids,), example_kwargs={"use_cache": False, "attention_mask": mask},
                                split_spec={k: getattr(SplitPoint, v) for k, v in TRACED_SPEC.items()})
    assert stage_fn.num_stages == 4 and any("carried through stage 2" in e for e in stage_fn.skip_edges)
    loss_fn = lambda out, y: causal_lm_loss(out[0] if isinstance(out, tuple) else out, y)  # noqa: E731
    verify_split(model, stage_fn, ids, attention_mask=mask, use_cache=False, target=ids, loss_fn=loss_fn, rtol=1e-9)


@pytest.mark.parametrize("where", ["mid-block", "at-attention"])
def test_a_split_by_names_inside_a_decoder_block_is_caught(where: str) -> None:
    """A decoder layer whose parts sit on two stages runs on both with pass-throughs (the residual is added on each,
    the attention's pass-through returns one tensor where two are unpacked): another model, which verify_split
    refuses.  (stage_fn_for_causal_lm splits between whole layers only.)"""
    model = tiny()
    ids = ids_and_mask()[0][:2]  # (2 rows: the attention's pass-through output unpacks into its 2 rows, silently)
    cut = ["model.layers.1.input_layernorm"] + (["model.layers.1.self_attn"] if where == "mid-block" else [])
    rest = [n for n in ("model.layers.1.self_attn", "model.layers.1.post_attention_layernorm", "model.layers.1.mlp") if n not in cut]
    stage_fn = split_by_fqn(model, [["model.embed_tokens", "model.layers.0", *cut],
                                    [*rest, "model.layers.2", "model.layers.3", "model.norm", "lm_head"]], output_field="logits")
    with pytest.raises(PipelineConfigError, match="output differs from the whole model's"):
        verify_split(model, stage_fn, ids, use_cache=False)


class ShrinkLM(nn.Module):
    """A forward that shrinks the embedding's gradient (GLM's trick) in the root: with pass-throughs every stage
    shrinks it again, so the output is right and stage 0's gradients are 10 times too small."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h * 0.1 + h.detach() * 0.9
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_verify_split_holds_small_gradients_to_their_own_size() -> None:
    """Bug: every tensor was held to at least 1e-5 absolute; gradients of order 1e-4 (here a loss scaled by 1e-4,
    as a large vocabulary's head or a mean over many tokens gives) passed 10 times too small."""
    torch.manual_seed(0)
    model = ShrinkLM().double()
    stage_fn = split_by_fqn(model, [["embed", "layers.0"], ["layers.1", "head"]], placeholder="identity")
    x = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    for scale in (1.0, 1e-4):
        def loss_fn(out: torch.Tensor, y: torch.Tensor, s: float = scale) -> torch.Tensor:
            return F.cross_entropy(out.reshape(-1, 11), y.reshape(-1)) * s
        with pytest.raises(PipelineConfigError, match=r"gradient of \d+ parameter\(s\) differs.*'embed\.weight' \(stage 0\)"):
            verify_split(model, stage_fn, x, target=x, loss_fn=loss_fn)
    verify_split(model, split_by_fqn(model, [["embed", "layers.0", "layers.1", "head"]]), x, target=x,
                 loss_fn=lambda o, y: F.cross_entropy(o.reshape(-1, 11), y.reshape(-1)) * 1e-4)  # (one stage: exact)


def test_verify_split_refuses_a_tied_weight_copied_onto_two_stages() -> None:
    """A hand-written stage_fn that gives the first and last stage each its own copy of a tied weight: each copy
    gets its stage's part of the gradient, not the sum; refused, naming both copies (the message blames the
    forward, not the tie: see the report)."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mid(self.embed(x))))

    torch.manual_seed(0)
    model = Tied().double()
    whole = copy.deepcopy(model)

    class Stage(nn.Module):
        def __init__(self, first: bool) -> None:
            super().__init__()
            self.first = first
            src = copy.deepcopy(whole)
            self.embed, self.mid, self.head = (src.embed, src.mid, None) if first else (None, None, src.head)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.mid(self.embed(h))) if self.first else self.head(h)

    x = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    stage_fn = lambda i: Stage(i == 0)  # noqa: E731
    verify_split(model, stage_fn, x, num_stages=2)  # the output is the model's
    with pytest.raises(PipelineConfigError, match=r"gradient of 2 parameter\(s\) differs.*'(head|embed)\.weight' \(stage [01]\)"):
        verify_split(model, stage_fn, x, num_stages=2, target=x,
                     loss_fn=lambda o, y: F.cross_entropy(o.reshape(-1, 11), y.reshape(-1)))


class BufferLM(nn.Module):
    """Buffers every stage reads: a position table on the root (split across stages: kept on each), a buffer-only
    module no stage names (copied to each), read by every layer (torchtitan style: None checks)."""

    class Pos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("freq", torch.linspace(0.1, 1.0, 8, dtype=torch.float64))

        def forward(self, t: int) -> torch.Tensor:
            return torch.sin(torch.arange(t, dtype=torch.float64)[:, None] * self.freq)

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(16))
        self.pos = self.Pos()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        t = h.shape[1]
        p = self.pos(t) * self.position_ids[:t, None]
        for layer in self.layers:
            h = torch.tanh(layer(h) + p)
        return self.head(h) if self.head is not None else h


def test_buffers_read_by_every_stage_compose_exactly() -> None:
    torch.manual_seed(0)
    model = BufferLM().double()
    stage_fn = split_by_fqn(model, [["embed", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "head"]])
    assert all("pos.freq" in dict(stage_fn(i).named_buffers()) and "position_ids" in dict(stage_fn(i).named_buffers())
               for i in range(3))
    x = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    verify_split(model, stage_fn, x, target=x, loss_fn=lambda o, y: F.cross_entropy(o.reshape(-1, 11), y.reshape(-1)),
                 rtol=1e-12)


@pytest.mark.parametrize("extra", [
    {"attn_implementation": "eager", "output_attentions": True, "output_hidden_states": True},
    {"attn_implementation": "sdpa", "attention_dropout": 0.3},
])
def test_hf_stages_with_flags_masks_and_dropout_verify(extra: dict[str, Any]) -> None:
    """verify_split on stage_fn_for_causal_lm's stages with config flags that add outputs, a 4-D boolean mask (a
    causal mask that also hides a padded row's first tokens: eager attention would give the fully masked rows NaN
    in the model itself, so the padded keys are hidden from the later rows only) and, in training, attention
    dropout drawn alike by the chained stages."""
    model = tiny(**extra)
    ids, _ = ids_and_mask()
    t = ids.shape[1]
    mask4 = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(ids.shape[0], 1, t, t).clone()
    mask4[1, :, 3:, :3] = False
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=3)
    verify_split(model, stage_fn, ids, attention_mask=mask4, use_cache=False, target=ids, loss_fn=loss_fn, rtol=1e-9,
                 train="attention_dropout" in extra)
