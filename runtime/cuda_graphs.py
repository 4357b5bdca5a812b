"""CUDA graphs for stage modules (``RuntimeOptions.cuda_graphs``).

Why.  On GPUs a stage whose kernels are short is bound by the host: a small
GPT block launches dozens of kernels per forward and twice as many in the
backward, each 5-10 us of Python and driver time, and the device waits for
them (``benchmarks/RESULTS.md``: on 2 x H200 the actions' host spans were
88-93% of a size-s step, the model's own launches, not the runtime's).  Torch's
pipelining launches the same way.  A CUDA graph replays a captured forward or
backward with one launch.

What is captured.  Per stage, after the first training step that ran it on one
input layout (shapes, dtypes, which inputs require grad, the keyword arguments'
names in call order and their constant values, the autocast state, the
trainable parameters), its module's forward and the backward of that forward
to its inputs and trainable parameters, once per *slot*: a slot holds one
microbatch's activations from its forward until the autograd call that ran its
backward has returned (autograd reads the gradients the replay returned after the
replay, and the slot's next forward writes the same pool), so a stage gets as
many slots as the schedule keeps its microbatches alive at once (1F1B's first
stage: the number of stages), plus one where a backward may be launched beside the
next forward (``host_overlap_backward``).  Each slot has its own private memory pool, so
slots replay in any order, and a slot's forward and backward always replay in
the order they were captured in (its forward, then its backward, then the next
microbatch's forward).  Capturing happens between steps, on a side stream, after
the step's transfers have ended on this rank (``torch.cuda.graph`` synchronizes
the device; during a step a posted receive may wait on a peer that waits on
this rank).

How it is replayed.  The graphed forward is one autograd ``Function`` whose
inputs are the stage inputs and the trainable parameters: the forward copies
the inputs into the slot's static buffers and replays the forward graph; its
backward copies the output gradients in and replays the backward graph, and
returns the gradients, which reach ``.grad`` through the parameters' own
``AccumulateGrad`` nodes (accumulation over microbatches and gradient hooks behave as
without graphs; the static gradient buffers are never stolen as ``.grad``: they stay
referenced by the slot, so autograd copies them).  Data parallelism would compose the
same way but is refused until it has run on GPUs; FSDP and expert parallelism run
collectives inside the stage and are refused.

Where it falls back.  A forward whose inputs or trainable set differ from the
captured layout, one that finds every slot busy (a dynamic order keeping more
microbatches alive than the static list), an evaluation step, and keyword
arguments other than tensors on the stage's device and constants (None, bool,
int, float, str) run eagerly, exactly as without graphs.  Keyword tensors (a
Hugging Face layer's attention mask, position ids) are inputs of the graph like
the positional ones; keyword constants are part of the layout (another value, or
another call order of the names, which a ``**kwargs`` forward may see: eager).
A module must not write into a keyword tensor in place (eagerly the caller's
tensor would change; replayed, the graph's own copy).  A stage that cannot be
captured (host synchronisation inside, a data-dependent shape, outputs that are
not tensors, module hooks, which a replay would skip, other than pipeloom's own
pure ones marked ``GRAPH_SAFE_HOOK``) runs eagerly with a
one-time warning naming the stage and the reason; a module hook registered after
the capture drops the stage's graphs at the next step.  While a process-wide module
hook is registered (``torch.nn.modules.module.register_module_forward_hook`` and
its kin: a profiler's, a FLOP counter's) every graphed stage runs eagerly, so that
the hook sees its calls, and replays again once it is removed.  Parameters whose storage moved
(replaced, not updated in place) drop the stage's graphs; they are captured again
after the next step.

Limits (documented in ``RuntimeOptions.cuda_graphs``): the module must be a
function of its inputs and parameters on the device (no host reads of tensor
values, no Python-side state that changes between calls); warm-up and capture
run it three times on zero inputs (random numbers are drawn, buffers such as
batch-norm statistics are restored afterwards); a stage's backward is one opaque
node, so an I/W split schedule runs that stage's whole backward at I (as for a
``torch.compile`` region, ``runtime/stage.py``).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
import torch.nn.modules.module as _nn_module

__all__ = ["StageGraphs", "capturable_loss", "slots_per_stage"]

#: eager calls on one layout before it is captured (cuBLAS handles, lazy modules, autotuning)
WARMUP_CALLS = 1
#: forward/backward passes run on the side stream before capturing (torch's make_graphed_callables runs 3)
WARMUP_PASSES = 2


def capturable_loss(loss_fn: Any) -> bool:
    """Whether ``RuntimeOptions.cuda_graphs_loss`` may capture ``loss_fn`` with the last stage: not an ``nn.Module``
    with parameters or buffers of its own (a replay would neither train them nor read them anew)."""
    if loss_fn is None:
        return False
    if isinstance(loss_fn, nn.Module):
        return not any(True for _ in loss_fn.parameters()) and not any(True for _ in loss_fn.buffers())
    return True


def slots_per_stage(actions: Sequence[Any]) -> dict[int, int]:
    """Per stage of one rank's action list, the most microbatches alive at once (forward done,
    backward not yet): one graph slot each."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in actions:
        for leaf in a.leaves():
            t = leaf.type.value
            if t == "F":
                live[leaf.stage] = live.get(leaf.stage, 0) + 1
                peak[leaf.stage] = max(peak.get(leaf.stage, 0), live[leaf.stage])
            elif t in ("B", "I"):
                live[leaf.stage] = live.get(leaf.stage, 0) - 1
    return {s: max(n, 1) for s, n in peak.items()}


class _Slot:
    __slots__ = ("fwd", "bwd", "static_in", "static_out", "static_gout", "static_gin", "busy", "done", "out_kind", "gen",
                 "finished", "static_target", "target")

    def __init__(self, finished: list[tuple[_Slot, int]]) -> None:
        self.busy = False
        #: the last stage with its loss in the graph: the target's buffer, and the target of the replay under way
        self.static_target: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None
        #: forwards replayed in this slot: a backward must belong to the slot's latest one
        self.gen = 0
        #: its stage's slots whose backward replayed in the autograd call under way (StageGraphs.release); the
        #: backward runs on autograd's device thread, not on the thread that called autograd
        self.finished = finished


class _GraphedStage(torch.autograd.Function):
    """One replay of a captured stage forward; its backward replays the captured backward.
    (Its node's name, ``_GraphedStageBackward``, is what ``runtime/stage.py`` knows as unsplittable.)"""

    @staticmethod
    def forward(ctx: Any, slot: _Slot, n_in: int, *args: torch.Tensor) -> Any:  # type: ignore[override]
        if slot.done is not None:  # (its last backward may have replayed on another stream)
            torch.cuda.current_stream().wait_event(slot.done)
        for dst, src in zip(slot.static_in, args[:n_in]):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        if slot.static_target is not None:
            assert slot.target is not None
            if slot.static_target.data_ptr() != slot.target.data_ptr():
                slot.static_target.copy_(slot.target)
            slot.target = None
        slot.fwd.replay()
        slot.gen += 1
        ctx.slot, ctx.gen = slot, slot.gen
        outs = tuple(o.detach() for o in slot.static_out)
        ctx.mark_non_differentiable(*(o for o, g in zip(outs, slot.static_gout) if g is None))
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        slot: _Slot = ctx.slot
        if ctx.gen != slot.gen or not slot.busy:
            raise RuntimeError(
                "a CUDA-graphed stage's backward ran for a forward whose slot was reused (a second backward through "
                "the same graph, or one after the step that made it): it would read another microbatch's activations")
        for dst, g in zip(slot.static_gout, grads):
            if dst is None:
                continue
            if g is None:
                dst.zero_()
            elif dst.data_ptr() != g.data_ptr():
                dst.copy_(g)
        slot.bwd.replay()
        ctx.gen = -1  # (once)
        # The slot is released only when the whole autograd call has returned (StageGraphs.release): the
        # gradients returned here are the slot's buffers, which the parameters' AccumulateGrad nodes read after
        # this (copied into .grad, or added: never stolen, the slot still references them), and the next forward
        # replay in the slot writes that memory (one pool for the slot's forward and backward).
        slot.finished.append((slot, slot.gen))
        return (None, None, *slot.static_gin)


def _flatten(out: Any) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    if isinstance(out, torch.Tensor):
        return "tensor", (out,)
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return ("tuple" if isinstance(out, tuple) else "list"), tuple(out)
    return None


def _unflatten(kind: str, outs: tuple[torch.Tensor, ...]) -> Any:
    if kind == "tensor":
        return outs[0]
    return outs if kind == "tuple" else list(outs)


#: The attribute that marks a forward (pre-)hook as part of what the module computes: a pure function of the call's
#: arguments or output, with no side effects and no state (pipeloom's own: ``split_by_fqn``'s output reducer, the
#: Hugging Face stages' input mapping).  Capture runs the module through ``__call__``, hooks included, so such a
#: hook's work is in the graph; any other hook would be skipped by a replay, and keeps the stage eager.
GRAPH_SAFE_HOOK = "_pipeloom_graph_safe"


def _graph_safe(hook: Any) -> bool:
    return getattr(hook, GRAPH_SAFE_HOOK, False) is True


#: The process-wide module hooks (``torch.nn.modules.module.register_module_forward_hook`` and its kin): they run
#: for every module's call, so a replay, which calls no module, would skip them.  torch keeps them in these private
#: dicts of ``torch.nn.modules.module`` and offers no public getter; a name missing in some version reads as empty.
_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
    ("_global_forward_hooks", "register_module_forward_hook"),
    ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
    ("_global_backward_hooks", "register_module_(full_)backward_hook"),
)


def _any_global_hooks() -> bool:
    """Whether any process-wide module hook is registered (a few dict reads: checked at every replay)."""
    return any(getattr(_nn_module, attr, None) for attr, _ in _GLOBAL_HOOKS)


def _global_hooks(ours: set[int]) -> str | None:
    """Why a replay would skip a process-wide module hook registered now (None: there is none, or only ours)."""
    for attr, api in _GLOBAL_HOOKS:
        hooks = getattr(_nn_module, attr, None) or {}
        foreign = [h for h in hooks.values() if id(getattr(h, "__func__", h)) not in ours and not _graph_safe(h)]
        if foreign:
            name = getattr(foreign[0], "__qualname__", type(foreign[0]).__name__)
            return (f"a process-wide module hook is registered ({name}, through torch.nn.modules.module.{api}): "
                    "it runs for every module's call, and a replay would not run it")
    return None


def _foreign_hooks(module: nn.Module, ours: set[int]) -> str | None:
    """Why a replay of ``module`` would skip a hook that an eager call runs (None: there is none but ours)."""
    return _global_hooks(ours) or _module_hooks(module, ours)


def _module_hooks(module: nn.Module, ours: set[int]) -> str | None:
    for name, m in module.named_modules():
        pre = [h for h in m._forward_pre_hooks.values() if id(getattr(h, "__func__", h)) not in ours and not _graph_safe(h)]
        post = [h for h in m._forward_hooks.values() if not _graph_safe(h)]
        if pre or post or m._backward_hooks or m._backward_pre_hooks:
            return f"module {name or type(module).__name__!r} has hooks (a replay would not run them)"
    return None


class StageGraphs:
    """The captured graphs of one stage (``None`` slots until :meth:`capture`)."""

    def __init__(self, stage: int, module: nn.Module, slots: int, device: torch.device, *, allowed_hooks: Sequence[Any] = (),
                 loss_fn: Any = None) -> None:
        self.stage = stage
        self.module = module
        #: the last stage's loss function: captured with the module (one replay computes the loss, and the backward
        #: starts from it) when the target is a tensor; see :meth:`_layout`
        self.loss_fn = loss_fn
        self.n_slots = slots
        self.device = device
        self._allowed_hooks = {id(getattr(h, "__func__", h)) for h in allowed_hooks}
        #: why this stage stays eager (set once, with a warning), or None
        self.disabled: str | None = None
        #: a process-wide module hook kept it eager for a while (warned once)
        self._deferred = False
        #: the layout seen on eager training calls, and how many times
        self.layout: tuple[Any, ...] | None = None
        self._seen = 0
        self._trainable_at: tuple[Any, ...] = ()
        self.slots: list[_Slot] = []
        self._finished: list[tuple[_Slot, int]] = []
        self._params: list[nn.Parameter] = []
        self._ptrs: tuple[tuple[int, int], ...] = ()
        #: the module modifies an input in place: it is given copies (as ``StageExecutor._call`` does)
        self.copy_inputs = False
        #: forwards replayed in the current step, and over the stage's life
        self.replays_step = 0
        self.replays = 0

    # -- layout ---------------------------------------------------------------
    def _layout(self, inputs: Sequence[Any], kwargs: dict[str, Any], target: Any = None) -> tuple[Any, ...] | None:
        """What a capture depends on: the inputs' shapes, dtypes and which need a gradient (positional, then the
        keyword tensors), the keyword names in the call's order (a ``**kwargs`` forward sees that order) and the
        constants' values, the autocast state, and on a last stage whose loss is captured with it, the target's
        shape and dtype (None: not graphable)."""
        if not inputs and not kwargs:
            return None
        sig = []
        for t in inputs:
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                return None
            sig.append((tuple(t.shape), t.dtype, t.requires_grad))
        kw = []
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                if v.device != self.device:
                    return None
                kw.append((name, True, (tuple(v.shape), v.dtype, v.requires_grad)))
            elif type(v) is float:
                kw.append((name, False, (float, repr(v))))  # (its repr: 0.0 == -0.0, nan != nan)
            elif v is None or type(v) in _CONSTANTS:
                kw.append((name, False, (type(v), v)))  # (the type too: 1 == 1.0 == True)
            else:
                return None
        dt = self.device.type
        amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
        if self.loss_fn is None:
            return (tuple(sig), tuple(kw), amp)
        # the last stage: its loss is captured with the module when the target is one tensor on the device that
        # needs no gradient (the usual labels); any other target keeps the loss eager after a module-only replay
        tgt = None
        if isinstance(target, torch.Tensor) and target.device == self.device and not target.requires_grad:
            tgt = (tuple(target.shape), target.dtype)
        return (tuple(sig), tuple(kw), amp, tgt)

    def _trainable(self) -> tuple[Any, ...]:
        """What the graphs depend on beyond the inputs: which parameters are trained, which modules are in
        training mode (dropout, batch-norm statistics)."""
        return (tuple(p.requires_grad for p in self.module.parameters()), tuple(m.training for m in self.module.modules()))

    def _placement(self) -> tuple[tuple[int, int], ...]:
        """Which tensors the graphs read the parameters and buffers from (replaced ones are not read)."""
        return tuple((id(t), t.data_ptr()) for t in (*self.module.parameters(), *self.module.buffers()))

    def note(self, inputs: Sequence[Any], kwargs: dict[str, Any], target: Any = None) -> None:
        """An eager training forward: remember its layout (the first one; a stage whose layout varies keeps it)."""
        if self.disabled is not None or self.slots:
            return
        lay = self._layout(inputs, kwargs, target)
        if lay is None:
            return
        if self.layout is None:
            self.layout = lay
            self._trainable_at = self._trainable()
        elif lay != self.layout or self._trainable() != self._trainable_at:
            return  # (the first layout is the one captured; others run eagerly)
        self._seen += 1

    def wants_capture(self) -> bool:
        return self.disabled is None and not self.slots and self.layout is not None and self._seen >= WARMUP_CALLS

    def start_step(self) -> None:
        """At a step's start: no microbatch holds a slot (a failed step may have left some); parameters
        that moved (replaced rather than updated in place) drop the graphs."""
        self.replays_step = 0
        self._finished.clear()
        if not self.slots:
            return
        for s in self.slots:
            s.busy = False
        if self._placement() != self._ptrs or self._trainable() != self._trainable_at:
            self.drop()
            return
        why = _module_hooks(self.module, self._allowed_hooks)
        if why is not None:  # a hook registered since the capture: a replay would skip it
            self._disable(why)

    def release(self) -> None:
        """After the autograd call that ran a backward of this stage returned (``StageExecutor.backward`` /
        ``backward_input``, on the thread that called it): the slots whose backward replayed in it are free, once
        the device is past their last reads (an event on the calling thread's stream, which autograd ordered after
        every stream the backward ran on).  (One backward of a stage at a time: the worker runs them in order.)"""
        fin = self._finished
        if not fin:
            return
        stream = torch.cuda.current_stream()
        for slot, gen in fin:
            if slot.gen != gen:  # (left by an autograd call that failed, and re-forwarded since: not ours)
                continue
            ev = slot.done
            if ev is None:
                ev = slot.done = torch.cuda.Event()
            ev.record(stream)
            slot.busy = False
        fin.clear()

    def drop(self) -> None:
        """Forget the graphs and the layout (captured again after a step that runs it)."""
        self._params = []
        self.slots = []
        self._seen = 0
        self.layout = None

    # -- capture --------------------------------------------------------------
    def _defer(self, why: str) -> None:
        """Run eagerly for now (a process-wide hook is registered), warning once; replays resume once it is gone."""
        if not self._deferred:
            self._deferred = True
            warnings.warn(f"stage {self.stage}: runs eagerly while {why}; its CUDA graphs replay again once it is "
                          "removed", RuntimeWarning, stacklevel=3)

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.slots = []
        warnings.warn(f"stage {self.stage}: not captured as a CUDA graph ({why}); it runs eagerly", RuntimeWarning, stacklevel=3)

    def capture(self) -> None:
        """Capture the stage's slots (between steps: synchronizes the device)."""
        assert self.layout is not None
        why = _global_hooks(self._allowed_hooks)
        if why is not None:  # (often a passing tool's, a profiler's: not now, after a later step)
            self._defer(why)
            return
        why = _module_hooks(self.module, self._allowed_hooks)
        if why is not None:
            self._disable(why)
            return
        pos, kw, amp, *rest = self.layout
        tgt = rest[0] if rest else None  # (the last stage with its loss captured too: the target's shape, dtype)
        loss_fn = self.loss_fn
        params = [p for p in self.module.parameters() if p.requires_grad]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        dev = self.device
        side = torch.cuda.Stream(dev)

        # the graph's tensor inputs: the positional ones, then the keyword tensors in the layout's (name) order
        sig = [*pos, *(v for _, is_t, v in kw if is_t)]
        n_pos = len(pos)

        def sample() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=dev).requires_grad_(rg) for shape, dtype, rg in sig]

        def run(inputs: list[torch.Tensor]) -> Any:
            args, rest = inputs[:n_pos], iter(inputs[n_pos:])
            kwargs = {name: (next(rest) if is_t else _constant(v)) for name, is_t, v in kw}
            if self.copy_inputs:
                args = [t.clone() if t.requires_grad else t for t in args]
            if amp is not None:
                with torch.autocast(dev.type, dtype=amp):
                    return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)

        def traced(inputs: list[torch.Tensor], target: torch.Tensor | None) -> tuple[str, tuple[torch.Tensor, ...], list[bool]]:
            """The forward to capture: the module's outputs (flattened), and with a target the loss after them;
            and which of them the backward starts from (the loss alone, or every output that requires grad)."""
            out = run(inputs)
            flat = _flatten(out)
            if flat is None:
                raise _NotGraphable("its output is not a tensor or a tuple/list of tensors")
            kind, outs = flat
            if target is None:
                return kind, outs, [o.requires_grad for o in outs]
            if amp is not None:
                with torch.autocast(dev.type, dtype=amp):
                    loss = loss_fn(out, target)
            else:
                loss = loss_fn(out, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise _NotGraphable("its loss_fn does not return a scalar tensor that requires grad")
            return kind, (*outs, loss), [False] * len(outs) + [True]

        def target_sample() -> torch.Tensor | None:
            return None if tgt is None else torch.zeros(tgt[0], dtype=tgt[1], device=dev)

        def grads_of(outs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor], gouts: list[torch.Tensor | None]) -> tuple[Any, ...]:
            diff = [(o, g) for o, g in zip(outs, gouts) if g is not None]
            wrt = [t for t in inputs if t.requires_grad] + params
            if not diff or not wrt:
                return ()
            return torch.autograd.grad([o for o, _ in diff], wrt, grad_outputs=[g for _, g in diff], allow_unused=True)

        slots: list[_Slot] = []
        retry: str | None = None  # (the capture with the loss failed: why; the module is captured alone after)
        try:
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i in range(WARMUP_PASSES):
                    # the first pass with synchronizing calls made errors: a module that reads a value on the
                    # host cannot be captured, and a capture that fails half-way can leave the CUDA generator
                    # unusable, so it is found here, eagerly
                    old_mode = torch.cuda.get_sync_debug_mode()
                    if i == 0:
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        inputs = sample()
                        target = target_sample()
                        try:
                            _, outs, diff = traced(inputs, target)
                        except RuntimeError as exc:
                            if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc) or self.copy_inputs:
                                raise
                            self.copy_inputs = True  # (it modifies its input in place: copies, as eagerly)
                            _, outs, diff = traced(inputs, target)
                        grads_of(outs, inputs, [torch.ones_like(o) if d else None for o, d in zip(outs, diff)])
                    except RuntimeError as exc:
                        if i == 0 and "synchroniz" in str(exc):
                            raise _NotGraphable(f"it synchronizes with the host: {str(exc).splitlines()[0]}") from None
                        raise
                    finally:
                        if i == 0:
                            torch.cuda.set_sync_debug_mode(old_mode)
                    del inputs, target, outs
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            for _ in range(self.n_slots):
                slot = _Slot(self._finished)
                pool = torch.cuda.graph_pool_handle()
                slot.fwd, slot.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                slot.static_in = sample()
                slot.static_target = target_sample()
                with torch.cuda.graph(slot.fwd, pool=pool, stream=side, capture_error_mode="thread_local"):
                    slot.out_kind, outs, diff = traced(slot.static_in, slot.static_target)
                slot.static_out = outs
                slot.static_gout = [torch.zeros_like(o) if d else None for o, d in zip(outs, diff)]
                with torch.cuda.graph(slot.bwd, pool=pool, stream=side, capture_error_mode="thread_local"):
                    got = list(grads_of(outs, slot.static_in, slot.static_gout))
                # one gradient per Function input: the stage inputs (None where none is needed), the parameters
                gin: list[torch.Tensor | None] = []
                it = iter(got)
                for t in slot.static_in:
                    gin.append(next(it, None) if t.requires_grad else None)
                gin.extend(next(it, None) for _ in params)
                slot.static_gin = gin
                slot.static_out = tuple(o.detach() for o in outs)  # (not the captured graph's nodes)
                del outs, got
                slots.append(slot)
        except _NotGraphable as exc:
            if tgt is None:
                self._disable(str(exc))
                return
            retry = str(exc)
        except Exception as exc:  # noqa: BLE001 - a capture failure leaves the stage eager, loudly
            torch.cuda.synchronize(dev)
            _settle_generator(dev)
            why = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if tgt is None:
                self._disable(why)
                return
            retry = why
        finally:
            torch.cuda.current_stream(dev).wait_stream(side)  # (a warm-up cut short may still write the buffers)
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)
            gc.collect()
        if retry is not None:
            # the failed capture's graphs and pools are let go (this frame's references to them) before the module
            # is captured alone
            slots.clear()
            slot = outs = got = inputs = target = None  # noqa: F841
            self._without_loss(retry)
            return
        self._params = params
        self._ptrs = self._placement()
        self.slots = slots

    def _without_loss(self, why: str) -> None:
        """The module and its loss could not be captured together: capture the module alone (its loss runs
        eagerly after each replay), warning once."""
        warnings.warn(f"stage {self.stage}: its loss is not captured with it in a CUDA graph ({why}); the module is "
                      "captured alone and the loss runs eagerly", RuntimeWarning, stacklevel=3)
        self.loss_fn = None
        assert self.layout is not None
        self.layout = self.layout[:3]
        self.slots = []
        gc.collect()
        self.capture()

    # -- replay ---------------------------------------------------------------
    def call(self, inputs: Sequence[Any], kwargs: dict[str, Any], target: Any = None) -> tuple[Any, torch.Tensor | None] | None:
        """(The module's output, and the loss where it is captured too) by a replay, or None (the caller runs it
        eagerly).  The outputs and the loss are the slot's buffers until its backward has run."""
        if not self.slots or not torch.is_grad_enabled():
            return None
        if _any_global_hooks() and _global_hooks(self._allowed_hooks) is not None:
            self._defer(_global_hooks(self._allowed_hooks) or "")
            return None
        if self._layout(inputs, kwargs, target) != self.layout:
            return None
        for slot in self.slots:
            if not slot.busy:
                break
        else:
            return None
        slot.busy = True
        self.replays_step += 1
        self.replays += 1
        if slot.static_target is not None:
            slot.target = target  # (copied in on the replay's stream, after the slot's last reads)
        flat = [*inputs, *(kwargs[name] for name, is_t, _ in self.layout[1] if is_t)]
        outs = _GraphedStage.apply(slot, len(flat), *flat, *self._params)
        if slot.static_target is not None:
            return _unflatten(slot.out_kind, outs[:-1]), outs[-1]
        return _unflatten(slot.out_kind, outs), None


class _NotGraphable(Exception):
    pass


#: keyword argument values a capture keeps as constants (the layout holds the value: another value runs eagerly)
_CONSTANTS = (bool, int, float, str)


def _constant(key: tuple[type, Any]) -> Any:
    """A keyword constant from its layout entry (a float is kept as its repr, which round-trips exactly)."""
    kind, v = key
    return float(v) if kind is float else v


def _settle_generator(dev: torch.device) -> None:
    """After a capture that failed half-way: the CUDA generator may still believe it is capturing (torch ends
    its capture bookkeeping only when the capture ends well), and every later random draw would raise
    "Offset increment outside graph capture".  A capture that ends well ends it."""
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device=dev)
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            x.add_(1)
    except Exception:  # noqa: BLE001 - nothing more to do: the stage's own failure is reported
        pass
