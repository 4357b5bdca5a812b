"""Running one stage's module: forward, full backward, and the I/W split.

A stage keeps, per microbatch, what its backward needs: the input leaves
(received or handed-over activations, detached so the graph ends at the stage
boundary) and the outputs (or, on the last stage, the loss).

The zero-bubble split.  I computes the gradients of the stage's inputs so the
previous stage can go on; W computes the parameter gradients later, filling a
bubble.  W must give exactly what a full backward gives, for *any* autograd
graph (a module applied twice, recurrence, weights tied inside one stage,
parametrizations, custom Functions, in-place ops, checkpointing), and must not
redo I's work.

Alternatives considered.  Capturing each parameter-owning module's output in a
forward hook and running W as a backward from it to the module's own
parameters (this project's first version) is cheap but wrong as soon as a
parameter is used twice: the backward from the second use's output reaches the
parameter through the first use too, counting it twice.  Re-running a backward
from the stage outputs restricted to the parameters is exact but repeats the
whole activation-gradient chain.  What we do works on the autograd graph
itself, as torch's own pipelining does, and it is exact by construction:

* The *input closure* is every graph node that depends on a stage input: the
  nodes I must run.  The *weight side* of a leaf (a parameter, or any other
  leaf that requires grad) is what depends on it without depending on an
  input; its nodes never feed back into the input closure.
* The *boundary* nodes are the nodes of the input closure with an edge into a
  weight side (``addmm`` for a Linear: activation edge and weight edge).  I
  records the gradient arriving at each boundary node (a node pre-hook) while
  computing the input gradients; autograd computes only the activation-side
  outputs there, because only the inputs were asked for.
* W replays, per group of leaves that share boundary nodes, a backward from
  those boundary nodes (with their recorded gradients) to the leaves.  When a
  group has several boundary nodes, one may reach another through the
  activation chain (a parameter used twice): a pre-hook pins each boundary
  node's gradient to the recorded one, and a post-hook drops its
  activation-side outputs, so nothing is counted twice and the chain between
  them runs on undefined gradients (no arithmetic).
* A custom autograd Function on a boundary computes every output of its
  backward in one Python call, so I runs it whole: its weight-side outputs
  (taken by a node post-hook) go on into their leaves at the end of I, and W
  does not run it again, which would repeat its whole backward and any side
  effect of it (Megatron's ``main_grad += ...`` with None returned for the
  weight).  Those parameters' gradients are then complete after I.
* Gradients reach the leaves through their own AccumulateGrad nodes, so
  ``.grad`` accumulation, hooks and frozen/unfrozen parameters behave as in a
  full backward; the trainable set is whatever requires grad at that forward.

A graph that cannot be split (a ``torch.compile``d region, whose backward is a
single opaque node that cannot run twice; a reentrant checkpoint, which refuses
``autograd.grad``; a stage replayed from a CUDA graph) is detected at I: the stage then runs
a full backward at I and W does nothing, with a one-time warning.  Gradients
stay exact; only the overlap is lost.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["StageExecutor", "as_tensor_tuple"]

#: autograd node types whose backward cannot be split: a compiled region's single opaque
#: node (cannot run twice with donated buffers) and reentrant checkpointing (refuses
#: ``autograd.grad`` and runs its own full backward inside)
_UNSPLITTABLE = {
    "CompiledFunctionBackward": "a torch.compile region",
    "CheckpointFunctionBackward": "a reentrant checkpoint (use_reentrant=True)",
    "_GraphedStageBackward": "a CUDA graph of the stage (RuntimeOptions.cuda_graphs)",
}


def as_tensor_tuple(value: Any, *, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors; anything else is a clear error."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(
        f"{what} must be a tensor or a tuple/list of tensors to cross a stage boundary, got {type(value).__name__}"
    )


@dataclass
class _WeightGroup:
    """One W backward: seeds (edges with their gradients) to a set of leaves."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    leaves: list[torch.Tensor]
    #: (boundary node, its recorded gradients, which of its edges are activation side), when
    #: the group has several boundary nodes (one may reach another through the activation chain)
    pinned: list[tuple[Node, tuple[torch.Tensor | None, ...], tuple[bool, ...]]]
    #: custom autograd Function boundary nodes whose weight side I did (W must not run them again), when the group
    #: has several boundary nodes (one may be reached through another)
    quiet: list[Node]


@dataclass
class _Saved:
    inputs: tuple[torch.Tensor, ...]
    #: which inputs were leaves needing a gradient at the forward (the module may have
    #: modified an input in place since, making it a non-leaf of its own graph)
    needs_grad: tuple[bool, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()
    loss: torch.Tensor | None = None
    #: what W still has to do, set by I (empty when I already did everything)
    weight_work: list[_WeightGroup] | None = None


def _grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient for ``t`` enters: its grad_fn, or its AccumulateGrad for a leaf."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]  # the leaf's (cached) AccumulateGrad
    return None


def _plan_weight_work(
    roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[dict[Node, tuple[bool, ...]], list[tuple[list[Node], list[Node], list[Node]]], str | None]:
    """Walk the graph once: boundary nodes, and per leaf group (boundary nodes, root seeds, leaves).

    Returns ``(activation_side, groups, unsplittable)``: for each boundary node, which
    of its edges lead into the input closure; per group, its boundary nodes, the
    root nodes on its weight side, and its leaves' AccumulateGrad nodes;
    ``unsplittable`` names what prevents a split, or is None.
    """
    root_nodes = [n for n in map(_grad_node, roots) if n is not None]
    consumers: dict[Node, list[Node]] = {}
    leaves: list[Node] = []
    seen: set[Node] = set(root_nodes)
    stack = list(seen)
    unsplittable: str | None = None
    while stack:
        n = stack.pop()
        name = type(n).__name__
        if name in _UNSPLITTABLE:
            unsplittable = _UNSPLITTABLE[name]
        elif name == "AccumulateGrad":
            leaves.append(n)
        for fn, _ in n.next_functions:
            if fn is None:
                continue
            c = consumers.get(fn)
            if c is None:
                consumers[fn] = [n]
            else:
                c.append(n)
            if fn not in seen:
                seen.add(fn)
                stack.append(fn)
    if unsplittable is not None:
        return {}, [], unsplittable
    input_nodes = {n for n in map(_grad_node, inputs) if n is not None and n in seen}
    closure = set(input_nodes)
    stack = list(input_nodes)
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if c not in closure:
                closure.add(c)
                stack.append(c)
    roots_set = set(root_nodes)
    # Per leaf: the boundary nodes and root nodes its weight side reaches.  Leaves
    # sharing a boundary node form one group (one W backward).
    group_of: dict[Node, int] = {}
    groups: list[tuple[set[Node], set[Node], list[Node]] | None] = []
    for leaf in leaves:
        if leaf in input_nodes:
            continue
        boundary: set[Node] = set()
        root_seeds: set[Node] = set()
        side = {leaf}
        stack = [leaf]
        while stack:
            n = stack.pop()
            if n in roots_set:
                root_seeds.add(n)
            for c in consumers.get(n, ()):
                if c in closure:
                    boundary.add(c)
                elif c not in side:
                    side.add(c)
                    stack.append(c)
        merged = {group_of[b] for b in boundary if b in group_of}
        if merged:
            gi = min(merged)
            g = groups[gi]
            assert g is not None
            for other in merged - {gi}:
                og = groups[other]
                assert og is not None
                g[0].update(og[0])
                g[1].update(og[1])
                g[2].extend(og[2])
                groups[other] = None
            g[0].update(boundary)
            g[1].update(root_seeds)
            g[2].append(leaf)
        else:
            gi = len(groups)
            groups.append((boundary, root_seeds, [leaf]))
        for b in groups[gi][0]:  # type: ignore[index]
            group_of[b] = gi
    # Groups seeded from the stage outputs themselves (weight sides that reach an output
    # without meeting the input closure, e.g. every leaf of a first stage) become one
    # group: separate backwards from the same outputs would each walk the whole chain.
    from_roots: tuple[set[Node], set[Node], list[Node]] = (set(), set(), [])
    out = []
    for g in groups:
        if g is None:
            continue
        if g[1]:
            from_roots[0].update(g[0])
            from_roots[1].update(g[1])
            from_roots[2].extend(g[2])
        else:
            out.append((list(g[0]), [], g[2]))
    if from_roots[2]:
        out.append((list(from_roots[0]), list(from_roots[1]), from_roots[2]))
    activation_side = {
        b: tuple(fn is not None and fn in closure for fn, _ in b.next_functions) for bs, _, _ in out for b in bs
    }
    return activation_side, out, None


def _nonleaf_grad(t: torch.Tensor) -> torch.Tensor | None:
    """``.grad`` of a first-stage input that is not a leaf (a view of a caller's batch that requires grad): set only by
    a backward that named it in ``inputs=``, None after a full backward (which went on into the caller's graph); read
    without torch's warning about non-leaf ``.grad`` (the caller did nothing wrong)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return t.grad


def _copy_leaf(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad else t


class StageExecutor:
    """Forward and backward of one stage module, per microbatch."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        is_last: bool,
        loss_fn: Callable[..., torch.Tensor] | None,
        grad_scale: float,
        split_backward: bool = False,
    ) -> None:
        self.index = index
        self.module = module
        self.is_last = is_last
        self.loss_fn = loss_fn
        self.grad_scale = grad_scale
        #: whether this stage runs I and W (the graph walk at I finds the leaves, so
        #: swapped FSDP parameters and a changed trainable set need nothing special)
        self.split_backward = split_backward
        self._saved: dict[int, _Saved] = {}
        #: RuntimeOptions.cuda_graphs: the stage's captured graphs (runtime/cuda_graphs.py), set by the Pipeline
        self.graphs: Any = None
        #: RuntimeOptions.defer_graph_teardown: where a full backward leaves its graph's nodes for the runtime to
        #: free later (the actor's list, shared by its stages; None: freed when the backward returns)
        self.graves: list[Any] | None = None
        #: the last stage, float16 loss scaling (runtime/grad_scaler.py): multiplies each microbatch's loss by the
        #: current scale where its backward is seeded; None: unscaled
        self.loss_scaler: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._warned_unsplittable = False
        #: the module modifies its inputs in place (see _call); None: not known yet
        self._copy_inputs: bool | None = None
        # Activation checkpointing: a module whose forward runs again during I is being
        # recomputed.  Its parameters' gradients are then taken in I's own backward
        # (one graph task, one recomputation) instead of in W, which would recompute
        # the region a second time.  Learned at the first I; sticky.  A parameter the region uses
        # directly (``checkpoint(self._body, h)`` with ``self.gain`` read in ``_body``: no module
        # of its own runs again) is found at W instead, when its group's backward recomputes the
        # region (a module forward runs during it): from the next microbatch on, it is taken at I.
        self._in_backward = False
        self._in_weight = False
        self._weight_recomputed = False
        self._recomputed: set[nn.Module] = set()
        self._at_i: set[int] = set()
        if split_backward:
            for m in module.modules():
                if any(True for _ in m.parameters(recurse=False)):
                    m.register_forward_pre_hook(self._note_recompute)

    def _note_recompute(self, module: nn.Module, args: Any) -> None:
        if self._in_weight:
            self._weight_recomputed = True
        elif self._in_backward and module not in self._recomputed:
            self._recomputed.add(module)
            self._at_i.update(id(p) for p in module.parameters(recurse=False))

    def forward(
        self,
        mb: int,
        inputs: Sequence[torch.Tensor],
        kwargs: dict[str, Any],
        target: Any = None,
        *,
        train: bool = True,
    ) -> tuple[tuple[torch.Tensor, ...], Any, torch.Tensor | None]:
        """Run the module; return (outputs for the next stage, raw output, loss or None)."""
        needs_grad = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        loss = None
        if train:
            # (a last stage replayed from a CUDA graph may compute its loss in the same replay)
            out, loss = self._call(inputs, kwargs, target if self.is_last and self.loss_fn is not None else None)
        else:
            with torch.no_grad():
                out = self.module(*inputs, **kwargs)
        if self.is_last:
            if loss is None and self.loss_fn is not None and target is not None:
                loss = self.loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
            if train:
                if loss is None:
                    raise ValueError("training needs loss_fn and a target on the last stage")
                self._saved[mb] = _Saved(tuple(inputs), needs_grad, loss=loss)
            return (), out, loss
        outputs = as_tensor_tuple(out, what=f"the output of stage {self.index}")
        if train:
            self._saved[mb] = _Saved(tuple(inputs), needs_grad, outputs=outputs)
        return outputs, out, None

    def _call(self, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any], target: Any = None) -> tuple[Any, torch.Tensor | None]:
        """(The module on this microbatch's inputs, which are leaves when they need a gradient; the loss, where a
        CUDA graph of the last stage computed it with the module (``target`` given), else None).

        In the unsplit model a stage's input is an intermediate tensor, so the module may
        modify it in place (``x += pos``, ``x.mul_(scale)``); a leaf that requires grad
        refuses that.  So the stage's first training forward with such a leaf runs on copies
        of its inputs, and if it modified one in place, the stage always gets copies from
        then on (one activation copy per microbatch; the leaves still receive the
        gradients).  Running the forward again after the leaf's error instead would repeat
        what it did before the in-place op (a buffer updated, a counter, random numbers
        drawn): that remains only for a stage that starts modifying its input in a later
        forward.
        """
        graphs = self.graphs
        if graphs is not None:
            got = graphs.call(inputs, kwargs, target)
            if got is not None:
                return got
            out = self._eager(inputs, kwargs)
            # (noted once the eager forward has returned: a call that raised, e.g. with a keyword argument the
            # stage refuses, must not become the layout that is captured)
            graphs.note(inputs, kwargs, target)
            return out, None
        return self._eager(inputs, kwargs), None

    def _eager(self, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]) -> Any:
        if self._copy_inputs:
            return self.module(*(_copy_leaf(t) for t in inputs), **kwargs)
        if self._copy_inputs is None and any(isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad for t in inputs):
            copies = [_copy_leaf(t) for t in inputs]
            versions = [c._version if c is not t else None for c, t in zip(copies, inputs)]
            out = self.module(*copies, **kwargs)
            self._copy_inputs = any(c is not t and c._version != v for c, t, v in zip(copies, inputs, versions))
            if self._copy_inputs:
                warnings.warn(
                    f"stage {self.index} modifies its input in place; it runs on a copy of its inputs",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return out
        try:
            return self.module(*inputs, **kwargs)
        except RuntimeError as exc:
            if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
                raise
            if not any(isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad for t in inputs):
                raise
            self._copy_inputs = True
            warnings.warn(
                f"stage {self.index} modifies its input in place; from now on it runs on a copy of "
                "its inputs (the forward that raised was run again: what it did before the in-place op, "
                "such as a buffer update, was done twice)",
                RuntimeWarning,
                stacklevel=4,
            )
            return self.module(*(_copy_leaf(t) for t in inputs), **kwargs)

    def _roots(self, saved: _Saved, grad_outputs: Sequence[torch.Tensor | None] | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.is_last:
            assert saved.loss is not None
            seed = saved.loss * self.grad_scale
            return [seed if self.loss_scaler is None else self.loss_scaler(seed)], None
        if grad_outputs is None or len(grad_outputs) != len(saved.outputs):
            raise ValueError(
                f"stage {self.index} has {len(saved.outputs)} outputs but received "
                f"{0 if grad_outputs is None else len(grad_outputs)} gradients"
            )
        roots, grads = [], []
        for o, g in zip(saved.outputs, grad_outputs):
            if g is None or not o.requires_grad:
                continue
            if g.shape != o.shape:
                raise ValueError(f"stage {self.index}: gradient of shape {tuple(g.shape)} for an output of shape {tuple(o.shape)}")
            roots.append(o)
            grads.append(g)
        return roots, grads

    def _input_grads(self, saved: _Saved) -> list[torch.Tensor | None]:
        return [(t.grad if t.is_leaf else _nonleaf_grad(t)) if need else None for t, need in zip(saved.inputs, saved.needs_grad)]

    def backward(self, mb: int, grad_outputs: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """Full backward (B): accumulate parameter gradients, return the input gradients."""
        saved = self._saved.pop(mb)
        roots, grads = self._roots(saved, grad_outputs)
        if roots:
            torch.autograd.backward(roots, grads)
            if self.graphs is not None:
                self.graphs.release()
            if self.graves is not None:
                # the graph's nodes live on in the list (its tensors go with ``saved`` now): freeing a graph is
                # host work the runtime does later, after the next action's launch or while it waits.  The input
                # leaves stay referenced by their gradient accumulators meanwhile; past the first stage (whose
                # inputs are the caller's tensors) they are the runtime's, and their gradients, handed to the
                # caller here, are not kept on them.
                self.graves.append([r.grad_fn for r in roots])
                got = self._input_grads(saved)
                if self.index > 0:
                    for t in saved.inputs:
                        if isinstance(t, torch.Tensor) and t.grad is not None:
                            t.grad = None
                return got
        return self._input_grads(saved)

    def backward_input(self, mb: int, grad_outputs: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """I: input gradients now; the weight-gradient work is recorded for W (see the module docstring)."""
        saved = self._saved[mb]
        roots, grads = self._roots(saved, grad_outputs)
        want_inputs = [t for t, need in zip(saved.inputs, saved.needs_grad) if need]
        if not roots:
            saved.weight_work = []
            return [None] * len(saved.inputs)
        if grads is None:
            grads = [torch.ones_like(r) for r in roots]
        activation_side, groups, unsplittable = _plan_weight_work(roots, want_inputs)
        if unsplittable is not None:
            if not self._warned_unsplittable:
                self._warned_unsplittable = True
                warnings.warn(
                    f"stage {self.index}: its autograd graph holds {unsplittable}, whose backward "
                    "cannot be split into I and W; this stage runs a full backward at I and W does nothing. "
                    "Gradients are exact; only the zero-bubble overlap is lost for this stage.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            torch.autograd.backward(roots, grads)
            if self.graphs is not None:
                self.graphs.release()
            saved.weight_work = []
            return self._input_grads(saved)
        now: list[torch.Tensor] = []  # leaves whose gradient is taken in I (recomputed regions)
        if self._at_i:
            deferred = []
            for grp in groups:
                leaves = [n.variable for n in grp[2]]
                if any(id(v) in self._at_i for v in leaves):
                    now.extend(leaves)
                else:
                    deferred.append(grp)
            groups = deferred
        recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        # A custom autograd Function's backward computes its weight-side gradients in I already (it is one Python
        # call), and may have side effects (Megatron-style ``main_grad += ...``, returning None for the weight):
        # its weight-side outputs are taken here and accumulated below it at once, and W does not run it again
        # (which would repeat its whole backward, side effects included, and hold nothing more until W).
        captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        handles = []
        self._in_backward = True
        try:
            for bnodes, _, _ in groups:
                for node in bnodes:
                    handles.append(node.register_prehook(lambda g, node=node: recorded.__setitem__(node, g)))
                    if isinstance(node, BackwardCFunction):
                        act = activation_side[node]
                        handles.append(node.register_hook(
                            lambda gi, go, node=node, act=act: captured.__setitem__(
                                node, tuple(None if a else g for g, a in zip(gi, act)))))
            if now:
                torch.autograd.backward(roots, grads, retain_graph=True, inputs=want_inputs + now)
                input_grads = self._input_grads(saved)
            else:
                got: Sequence[torch.Tensor | None] = ()
                if want_inputs:
                    got = torch.autograd.grad(roots, want_inputs, grads, retain_graph=True, allow_unused=True)
                it = iter(got)
                input_grads = [next(it) if need else None for need in saved.needs_grad]
        finally:
            self._in_backward = False
            for h in handles:
                h.remove()
        # An input that is not a leaf (the first stage's microbatch of a caller's batch that requires grad: a view
        # of the caller's tensor) is where I stops; a full backward goes on into the caller's graph, so does this.
        # (Its node is no W work then: ``backward(inputs=...)`` above may have run it, and recorded its gradient.)
        # A first-stage input that is a leaf (a caller's tensor given whole to every microbatch: 0-d or
        # ``Replicate``; a ``Microbatches`` piece) gets its gradient accumulated into ``.grad``, as a full backward
        # does; ``autograd.grad`` above does not accumulate (``backward(inputs=...)`` in the other branch did).
        # One tensor passed in several positions (``step(h, s, s)``) is sent on once: ``autograd.grad`` gave
        # each position its whole gradient.
        upstream: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, need, g in zip(saved.inputs, saved.needs_grad, input_grads):
            if (need and g is not None and (t.grad_fn is not None or (self.index == 0 and not now))
                    and all(t is not u for u, _ in upstream)):
                upstream.append((t, g))
        if upstream:
            for t, _ in upstream:
                recorded.pop(t.grad_fn, None)
            torch.autograd.backward([t for t, _ in upstream], [g for _, g in upstream])
        # Per root node, every output edge seeded from it with its gradient: several outputs may share a node
        # (``chunk``/``split``/``unbind`` outputs, the same tensor returned twice), and each gradient counts.
        root_grad: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = {}
        for r, g in zip(roots, grads):
            edge = get_gradient_edge(r)
            root_grad.setdefault(edge.node, []).append((edge, g))
        if captured:  # the custom Functions' weight-side gradients, on into their leaves now (see above)
            below = [(GradientEdge(fn, idx), g) for node, kept in captured.items() if node in recorded
                     for (fn, idx), g in zip(node.next_functions, kept) if fn is not None and g is not None]
            if below:
                into = [n.variable for bnodes, _, leaves in groups if any(b in captured for b in bnodes) for n in leaves]
                torch.autograd.backward([e for e, _ in below], [g for _, g in below], retain_graph=True, inputs=into)
        work: list[_WeightGroup] = []
        for bnodes, root_seeds, leaves in groups:
            edges: list[GradientEdge] = []
            seed_grads: list[torch.Tensor] = []
            pinned = []
            quiet = []
            for node in bnodes:
                rec = recorded.get(node)
                if rec is None:
                    continue
                if node in captured:  # (a custom Function: its weight side was done in I)
                    if len(bnodes) > 1:
                        quiet.append(node)
                    continue
                for i, g in enumerate(rec):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        seed_grads.append(g)
                if len(bnodes) > 1:
                    pinned.append((node, rec, activation_side[node]))
            for node in root_seeds:
                for edge, g in root_grad.get(node, ()):
                    edges.append(edge)
                    seed_grads.append(g)
            if edges:
                tensors = [n.variable for n in leaves]
                work.append(_WeightGroup(edges, seed_grads, tensors, pinned, quiet))
        saved.weight_work = work
        # The outputs stay referenced until W: a custom autograd Function's node is kept
        # alive only by the graph above it (its Python object holds it weakly on torch
        # 2.11), and W starts a backward there.  Little is held for it: the boundary
        # nodes reference everything below them anyway.
        return input_grads

    def backward_weight(self, mb: int) -> None:
        """W: the weight gradients, from the boundary gradients I recorded."""
        saved = self._saved.pop(mb)
        if saved.weight_work is None:
            raise RuntimeError(f"stage {self.index}: W for microbatch {mb} before its I")
        last = len(saved.weight_work) - 1
        for i, grp in enumerate(saved.weight_work):
            handles = []
            try:
                for node, rec, act in grp.pinned:
                    # Pin the gradient to what I recorded, and keep the activation side
                    # quiet: another boundary node of this group may be reached through it.
                    handles.append(node.register_prehook(lambda g, rec=rec: rec))
                    handles.append(node.register_hook(lambda gi, go, act=act: tuple(None if a else g for g, a in zip(gi, act))))
                for node in grp.quiet:  # (its weight side was done in I; if reached, it passes nothing on)
                    handles.append(node.register_prehook(lambda g: tuple(None for _ in g)))
                    handles.append(node.register_hook(lambda gi, go: tuple(None for _ in gi)))
                self._in_weight, self._weight_recomputed = True, False
                torch.autograd.backward(grp.edges, grp.grads, retain_graph=i < last, inputs=grp.leaves)
            finally:
                self._in_weight = False
                for h in handles:
                    h.remove()
            if self._weight_recomputed:
                self._at_i.update(id(t) for t in grp.leaves)
