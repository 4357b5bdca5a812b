"""The runtime's knobs: one frozen, typed, documented options object.

Problem.  The runtime's settings (timeouts, the tensor plane's layout, GPU
dispatch, trace output, data-parallel behaviour) used to be read from
``PIPELOOM_*`` environment variables wherever they were needed: in the actor,
the data-parallel code, the pipeline's setup.  A reader could not see in one
place what can be configured, with which unit and default; a test had to
patch the process environment; and two reads of the same variable could
disagree about how to parse it.

Alternatives.  (a) Keep environment reads but centralise the parsing
helpers: still global state read at a distance.  (b) Many keyword arguments
threaded through every constructor: explicit, but each new knob touches every
layer.  (c) One frozen, keyword-only dataclass, built once in
``Pipeline.__init__`` and passed down whole: every field is typed and
documented here, the environment is read in exactly one function
(:meth:`RuntimeOptions.from_env`), and a component takes the object (or the
fields it needs) as an argument.  That is (c), the shape of
``tools/launch.py``'s ``LaunchConfig``.

Precedence, in ``Pipeline``: explicit keyword arguments (``heartbeat_timeout=``,
``overlap_collectives=``...) over ``options=`` over the environment.  Passing
``options=`` replaces the environment entirely (nothing is read from it);
``RuntimeOptions.from_env(stall_timeout=60)`` keeps the launcher's settings
and overrides some.

What stays outside: ``PIPELOOM_LAUNCHER``, ``PIPELOOM_JOB_SECRET`` and the
``PIPELOOM_ROOT_CAUSE`` lines are the launcher <-> rank protocol (not
settings a user tunes) and are handled in ``runtime/pipeline.py`` alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["RuntimeOptions", "ENV_VARS", "resolve_options"]

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """How one rank's runtime behaves (the same on every rank of a job)."""

    backend: str | None = None
    """torch.distributed backend used when the Pipeline initialises the process group:
    ``"gloo"`` or ``"nccl"``; None picks NCCL if CUDA is available, else gloo.
    Environment: ``PIPELOOM_BACKEND``."""

    deterministic: bool = False
    """Run each rank's action list in exact order (debugging, bit-exact comparison with torch)."""

    dispatch: str = "auto"
    """Which ready action runs next when not ``deterministic`` (``schedules/dispatch.py``):
    ``"ready"`` the first ready one in list order; ``"critical"`` the ready one with the longest
    planned remaining path to the step's end, W last; ``"guarded"`` the list's head as soon as
    it is ready, a later action only if it fits in the wait the static plan leaves before the
    head (backfilling: never delays the head in the plan); ``"auto"`` (default) the rule the policy
    simulator predicts beats the static order by more than 2% on some uneven workload
    (lengths, jitter, a slow rank) and loses at most 0.5% on any, fixed lengths included,
    else the static list order itself (``schedules.dispatch.choose_rule``, simulated with this
    transport's send order and, on CPU ranks, notice delay); on GPU ranks ``auto`` is the list order
    (their host commits actions ahead of the device in list order, and no simulated gain held
    there when measured: ``runtime.actor._auto_rule``).  Every rule keeps the static order's
    memory peak and is deadlock-free.  With static shapes a rule runs a later action ahead only if
    its outputs to other ranks are next in their send order (gloo and NCCL).
    Environment: ``PIPELOOM_DISPATCH``."""

    heartbeat_interval: float = 0.5
    """Seconds between liveness heartbeats this rank sends to every peer."""

    heartbeat_timeout: float = 10.0
    """Seconds of silence after which a waiting rank declares a peer lost (default 10).
    Environment: ``PIPELOOM_HEARTBEAT_TIMEOUT`` (``pipeloom launch --heartbeat-timeout``)."""

    stall_timeout: float = 30.0
    """Seconds a peer may stay inside one action while this rank waits for it before it is
    reported as stalled (default 30; must exceed the slowest action).
    Environment: ``PIPELOOM_STALL_TIMEOUT`` (``pipeloom launch --stall-timeout``)."""

    first_step_stall_timeout: float | None = None
    """The stall timeout of a *cold* step: the first, and the first after the parameters
    (which, ``requires_grad``, shapes), the modules' train/eval mode or the step kind
    (step/eval) changed, when ``torch.compile`` traces and compiles (seconds; None:
    ``max(300, 10 * stall_timeout)``; never below ``stall_timeout``).  Each rank sends the
    budget of its current step in its heartbeats, so peers judge it by its own.
    Environment: ``PIPELOOM_FIRST_STEP_STALL_TIMEOUT`` (``--first-step-stall-timeout``)."""

    setup_timeout: float = 300.0
    """Seconds a rank waits, while building its Pipeline, for every other rank to reach the
    same construction checkpoint (where the ranks check that they build the same Pipeline;
    see :mod:`pipeloom.runtime.agreement`) before it names the ranks that did not."""

    check_finite: bool = False
    """Check every action's outputs, loss and gradients for NaN/inf and fail (``StageError``
    around ``FloatingPointError``) naming the stage, microbatch and action where one first
    appears.  Off by default: a reduction per tensor and, on GPUs, a device sync per action."""

    dp_buffers: str = "refuse"
    """With data parallelism: what a forward that updates a buffer in place (BatchNorm's running statistics, an
    EMA, a counter) does.  ``"refuse"`` (default): a ``PipelineConfigError`` at the first such forward, naming
    the stage, microbatch and buffer: each replica updates its own copy from its own rows, which no
    single-process run does.  ``"replica0"``: allowed, and after every training step each stage's buffers are
    broadcast from its first replica, so the replicas hold the same values (torch DDP's
    ``broadcast_buffers=True`` broadcasts rank 0's before each forward: the same state, one broadcast per step
    instead of per forward); the statistics then come from replica 0's rows alone.  Environment:
    ``PIPELOOM_DP_BUFFERS``."""

    tied_weights: str = "sync"
    """A weight tied across stages on different pipeline ranks (an input embedding reused by the output head, as in
    GPT-2, Llama-3.2-1B and Qwen's small models; one block object at several depths, as in ALBERT), found at
    construction (``runtime/ties.py``).  ``"sync"`` (default): trained as one weight, as Megatron and DeepSpeed do:
    every holding rank's copy starts from the lowest holding rank's (broadcast at construction), and after every
    training step the step's gradient of each copy is summed over the holding ranks (one all-reduce per set of
    ranks), so every copy holds the unsplit model's gradient; ``Pipeline.clip_grad_norm_`` counts it once.  Not with
    ``fsdp=True`` or expert parallelism (refused).  ``"refuse"``: such a tie is refused at construction (the
    behaviour before the sync existed).  A tie on one rank (a V schedule's first and last stage) is one local
    Parameter either way."""

    trace: str | None = None
    """Path of the trace file to record (one file per rank without a collector); None: no
    trace unless ``trace_endpoint`` is set.  Environment: ``PIPELOOM_TRACE`` (``--trace``)."""

    trace_endpoint: str | None = None
    """ZeroMQ address of the launcher's trace collector; when set, trace events stream there
    instead of to ``trace``.  Set by ``pipeloom launch --trace``.
    Environment: ``PIPELOOM_TRACE_ENDPOINT``."""

    pair_groups: bool = False
    """Tensor plane on gloo: one two-rank process group per pair of neighbouring ranks (True)
    instead of the default group (False).  Always on with NCCL, which needs them.
    Environment: ``PIPELOOM_PAIR_GROUPS=1``."""

    gloo_prepost_depth: int = 8
    """gloo: how many of a peer's transfers of a step this rank keeps posted ahead of the one
    it waits for (each a header plus buffers shaped like the previous step's; see
    ``transport/tensor.py``; with ``static_shapes=True`` the payload buffers alone, posted by
    the loop thread).  A transfer whose receive is posted before the data is sent lands in
    about a fifth of the time.  Larger: back-to-back sends (GPipe's forwards) find their
    receives posted; each costs one payload's memory while posted.  8 (was 2): on 2 CPU ranks
    with 8 microbatches, ``static_shapes=True`` steps were 10-25% shorter than with 2 and the
    default protocol's no slower (``benchmarks/RESULTS.md``, "CPU host path, round 5")."""

    gloo_park_ms: float = 2.0
    """CPU (gloo payloads, no data-parallel collectives): when nothing is ready, the dispatcher's
    thread first waits for the next landed transfer directly, for at most this many milliseconds,
    before sleeping on the event loop (``runtime/landing.py``): a landing then wakes it with one
    thread switch instead of a round trip through the loop's selector.  Control messages and the
    liveness check wait at most this long.  0: always sleep on the loop."""

    p2p_max_ctas: int | None = None
    """NCCL only: cap on the CTAs (thread blocks) each pair group's communicator uses; None:
    NCCL's default.  Environment: ``PIPELOOM_P2P_MAX_CTAS``."""

    batch_p2p: bool = False
    """Post each transfer's payload sends, and each transfer's payload receives, as one
    ``torch.distributed.batch_isend_irecv`` call (torch's runtime's way: on NCCL one coalesced
    group, with one ``Work`` for the group rather than one per operation) instead of one
    ``ProcessGroup.send``/``recv`` per tensor.  Off until measured: a cProfile of a host-bound
    GPU step put each standalone NCCL post at 124-170 us of host time against ~42 us per
    coalesced call in torch's runtime (``benchmarks/RESULTS.md``, session H), but the public
    batched call adds Python checks (on gloo it costs ~90 us more per post);
    ``benchmarks/p2p_cost.py`` measures both ways alone.  Environment: ``PIPELOOM_BATCH_P2P=1``."""

    ep_max_ctas: int | None = None
    """NCCL only, expert parallelism: cap on the CTAs (thread blocks) the stage groups' all-to-all
    kernels use, so that an overlapped half's compute keeps more SMs while the other half's
    dispatch or combine runs (``OVERLAP_F_B`` on two streams); None: NCCL's default.
    Environment: ``PIPELOOM_EP_MAX_CTAS``."""

    gpu_commit_ms: float = 10.0
    """GPUs: how far ahead the dispatcher commits actions whose inputs are committed (a local
    producer launched, or a transfer announced and its receive posted), in milliseconds of
    device time queued and not yet run (each action's GPU time is learned from CUDA events in
    the first steps; see ``runtime/device.py``).  Larger: the GPU queue is less likely to run
    dry; smaller: more actions stay uncommitted, free to be reordered around a late peer.
    0 commits only into an empty queue.  Environment: ``PIPELOOM_GPU_COMMIT_MS``."""

    gpu_commit_launches: float = 3.0
    """GPUs: the commit horizon also covers this many host launches of the slowest action: it
    is ``max(gpu_commit_ms, gpu_commit_launches x H)``, where ``H`` is the longest mean host
    time an action type takes to launch (learned from the step after its first one on).
    While the host launches one action the device runs what is queued; a queue shorter than the
    launch runs dry (measured on 2 H100s, a GPT whose backward takes the host about 10 ms to
    launch: a 10 ms horizon left 1F1B and GPipe 4.5-9% slower than torch, 30-60 ms within
    1%).  0: the fixed ``gpu_commit_ms`` alone.  Environment: ``PIPELOOM_GPU_COMMIT_LAUNCHES``."""

    gpu_commit_running: bool = True
    """GPUs: count what the oldest committed action has already run as no longer queued (its
    learned device time less the time since it began), so the horizon holds *remaining* device
    time.  False counts each action whole until its end event completes: an action longer than
    the horizon (a backward with the loss and a vocabulary head on the last stage) then holds
    every commit until it has finished, and the device idles while the host launches the next
    one.  For comparison; True is the engine's behaviour.  Environment:
    ``PIPELOOM_GPU_COMMIT_RUNNING=0``."""

    gpu_learn_sleep: bool = True
    """GPUs: in the steps an action type's device time is learned, the stream sleeps before
    the type's first launch in each (1.5 x the slowest host launch learned, 4-25 ms; through
    ``torch.cuda._sleep``; not before an OVERLAP_F_B, whose halves run on two streams), so that launch's CUDA events time its kernels alone rather than
    the host's pace on a host-bound rank (where an identical pipeline read the last rank's
    backward as 1.1 or 2.2 ms, and ``host_overlap_backward`` auto took opposite decisions); the
    least of the samples is learned.  Costs one sleep per action type in each learning step.
    False: events around the plain launches only.  Environment: ``PIPELOOM_GPU_LEARN_SLEEP=0``."""

    host_overlap_backward: bool | None = None
    """Launch a full backward (B) on a worker thread while the dispatcher launches the forwards
    that follow it in the list.  On a host-bound GPU job (many small microbatches) the host's
    launches bound the step, and during ``torch.autograd.backward`` the loop's thread only waits
    for the autograd engine's device thread: a 2 x H200 rank trace of a GPT's 1F1B step (session
    I, ``benchmarks/RESULTS.md``) spent 55-58% of it in B spans, 33-36% in F spans.  With this
    on, B(i) and the next F(i+1) are launched at the same time by two threads.

    ``None`` (default, "auto"): on GPUs only, and for each pair by where its kernels go.  A B
    and an F of stages on different streams (a rank with several stages and a stream for each:
    DualPipeV and the zero-bubble lists by default, any multi-stage list with
    ``overlap_streams=True``) are always overlapped: their kernels run side by side.  On one
    stream (a rank with one stage: 1F1B; Interleaved1F1B and LoopedBFS by default) the F's
    kernels are queued among the B's, so the B's input gradients,
    which the previous rank waits for, may leave up to one forward later; that costs nothing
    only where the device runs both while the host is still launching the B: such a pair is
    overlapped once the rank has learned (over its first steps, inline until then) that the B's
    mean host launch time exceeds the B's and the F's device times together by 25%
    (``runtime.device.backward_overlap_pays``, ``schedules.dispatch.OVERLAP_MARGIN``: one rank of four
    that learned 1.05-1.18x without the margin took a device-bound 1F1B to x1.32-1.36 of torch's,
    4 x H200, session M).  Session J, GPT, same process, overlap vs
    inline: 2 x H100 1F1B size s x0.78, Interleaved1F1B size s x0.75, size l x0.97; 4 x H200
    1F1B size s x0.76 (forced on), Interleaved1F1B size s x0.75-0.78; a device-bound 1F1B (size
    l) forced on took x1.41-1.50, which the rule keeps inline.  ``True``: every pair, on CPU
    ranks too (gloo: ``benchmarks/host_overlap.py``, x0.65 of the inline step with
    compute-bound microbatches and a free core).  ``False``: never.  Auto also stays off with
    ``profile_ranges`` (a profiler records the ops of the threads it was started on, so an
    overlapped backward's would be missing) and where a stage visibly issues collectives of
    its own (DTensor parameters, ``SyncBatchNorm``: issued from two threads, the ranks of their
    group could order them differently).  Set ``False`` yourself for a stage that issues
    collectives by hand (tensor parallelism written with ``all_reduce``), for a stage compiled
    with ``mode="reduce-overhead"`` (CUDA graph trees keep per-thread state), and while a
    dispatch mode (``FlopCounterMode``) or ``torch.profiler`` should see the backwards: the
    worker thread inherits the caller's autocast, its device and stream, nothing else
    thread-local.

    While a backward is in flight only forwards run beside it (one backward at a time: gradient
    accumulation keeps the list's order, as in the inline run), so a rank may hold one more
    microbatch's activations than inline while a backward and the next forward overlap; its
    outputs are sent when it has finished (static shapes keep each peer's list order), on GPUs
    from a stream of their own that waits for the backward's last kernel only (an event recorded
    on the worker), not for what the loop or the worker launched on its stream since.  Not
    with data or expert parallelism (their hooks and collectives are not thread-safe that way),
    nor for I/W (the split backward's graph hooks), nor with a dispatch rule that reorders (the
    launch order stays the list's), nor for a pair whose forward's input depends on the
    backward's output (possible in a custom list: ``schedules.dispatch.overlappable_backwards``
    keeps only pairs that cannot make a peer wait forever; the generated 1F1B and
    Interleaved1F1B lists keep all); there it runs inline as before.  Traced runs overlap as
    untraced ones do: the backward's span (from its launch to the worker's return) is recorded
    with ``"beside": true`` and ``pipeloom trace summary`` counts it where the loop ran no
    action and no send (its device time, on GPUs, ends at its own last kernel).  Random numbers: an
    activation checkpoint's recomputation restores the generator's process-wide state around
    itself, so a forward drawing from it on the other thread meanwhile would change the
    recomputed masks (a wrong gradient).  The first training step therefore runs inline and
    compares the CPU (and GPU) generators' states around it: forwards that draw (dropout) keep
    the overlap off; it also notes whether any backward runs a module's forward (a
    recomputation).  Every later training step is compared too: one whose forwards started
    drawing while backwards ran beside them turns the overlap off from the next step where the
    backwards recompute nothing (their masks were the inline run's), and fails loudly
    (``PipelineError``) where they recompute, instead of returning untrusted gradients (a
    checkpointed plain function, with no module inside, is not seen by that check).  Buffers that forwards update (batch norm's running statistics) may be
    updated in another order when a recomputation runs beside a forward.  Environment:
    ``PIPELOOM_HOST_OVERLAP_BACKWARD`` (``1``, ``0`` or ``auto``)."""

    defer_graph_teardown: bool = True
    """Free a finished full backward's autograd graph (its nodes: host work of 0.15-0.3 ms for a
    few transformer blocks) after the rank's *next* action has
    launched, or while the loop waits, instead of between the backward and that action.  The
    tensors autograd saved for the backward are freed during the backward as before; what lives on
    a little longer is the graph's nodes and what they hold: through their gradient accumulators,
    that microbatch's stage inputs (one boundary activation), and tensors a custom autograd
    Function keeps as attributes of its context.  Usually one such graph is pending, a few (the
    list is cut to two at each launch on the worker) where backwards launch on the worker thread
    (``host_overlap_backward``), none after the step.  (Not W of the I/W split: I retains its graph, so the activation side's
    saved tensors live until that graph is freed, which must stay at W's end.)  On a GPU
    rank whose host is as fast as its device only just (the last stage of a large model: its host
    launched each microbatch in 96-100% of the device's time, 4 x H200) the device idled for that
    work at each backward-to-forward switch; torch's runtime frees these graphs at the step's end.
    False: freed when the backward returns.  Environment: ``PIPELOOM_DEFER_GRAPH_TEARDOWN``."""

    host_overlap_trial: bool = True
    """With ``host_overlap_backward`` auto (the default) on GPUs: a pair the rule keeps inline on a rank whose
    host launches the B and the F after it in more time than its device runs them (the rank's device waits on
    its host every microbatch) is put to the test once every pair is decided: 4 blocks of 2 training steps
    alternate between inline and beside, and the pair stays beside only if the beside blocks' median step
    period is at least 3% shorter (``schedules.dispatch.OverlapTrial``).  The learned times alone do not tell
    which way pays near the rule's margin: 2 x H200, a GPT of size s with a 128k vocabulary head, 1F1B, the last
    rank kept inline took the step to x1.05-1.08 of torch's and beside to x0.93 (Interleaved1F1B x0.89 and
    x0.80), while a rank of a device-bound 1F1B that went beside took it to x1.32 (session M).  Costs up to 4
    steps in the worse setting, once (again after ``cuda_graphs`` captures); the outcome is logged (logger
    ``pipeloom.actor``, level INFO).  False: the rule alone, as before.  Environment:
    ``PIPELOOM_HOST_OVERLAP_TRIAL=0``."""

    host_queue_backwards: bool = False
    """With ``host_overlap_backward`` in effect (on GPUs by default), a backward that the list runs
    right after another backward is queued on the worker thread behind it, instead of waiting on
    the loop for the first one's launch to end: the loop hands the first one's input gradients on
    (its sends) and dispatches while the autograd engine launches the second (GPipe's and
    LoopedBFS's backward phases, the drain of 1F1B; a rank's backwards never launch at once: the
    worker runs them in list order, and gradient accumulation keeps the inline order).  At most
    two backwards are in flight; a queued backward's input must come from another rank (or none:
    the last stage), and its wait for that input (a stream wait on NCCL) is made on the worker
    after the first one's launch, so that on one stream it does not land among the first one's
    kernels.  Pairs that could make a peer wait forever are left inline
    (``schedules.dispatch.queueable_backwards``).  Measured once (4 x H200, GPT, 32
    microbatches): x0.93 of the default step on host-bound 1F1B, x0.96 on LoopedBFS, level where
    the device bounds the step; a second run did not agree (4 x H100, GPT size l, 16
    microbatches, 6 alternating rounds: 1F1B x1.001 of the default, GPipe x1.047): off.  Only under the ``list`` dispatch
    rule, as the overlap.  Environment:
    ``PIPELOOM_HOST_QUEUE_BACKWARDS=1``."""

    gpu_early_receives: bool = False
    """GPUs: post each NCCL receive on a separate transfer stream (True), so its data may land
    before the consumer's stream reaches it, or on the consumer's stream as torch does (False,
    default).  An early receive's kernel occupies SMs, spinning, until the sender's data comes:
    measured to slow compute by 3% (``gpu_commit_ms`` 10) to 30% (50) on 2 H100s.
    Environment: ``PIPELOOM_GPU_EARLY_RECEIVES=1``."""

    static_shapes: bool | None = None
    """NCCL: hand over activations and gradients without per-transfer headers once their
    shapes are known (``runtime/actor.py``, "Static shapes").  A step runs *headerless* when a
    step of the same kind (training, evaluation) with the same inputs ran before: each rank
    sends to a peer in its list order, and the receiver posts each receive and commits its
    consumer before the sender has even produced it, so no host waits for another's (torch's
    runtime works this way, with static shapes throughout).  Otherwise the step learns the
    shapes with headers, as on the first step.

    ``None`` (auto, default): "the same inputs" is agreed by all ranks at each step's start
    (one small all-gather on a gloo group): the shapes, dtypes and requires_grad of every
    tensor in every microbatch's inputs and targets on every rank, and the values of plain
    scalars; the last 16 such input layouts per kind are remembered, so a few recurring
    shapes (bucketed lengths, a smaller last batch) run headerless after their first step.
    ``True``: every step after the first of its kind runs headerless, without the agreement
    (for jobs whose inputs never change shape).  ``False``: always headers (the receiver
    learns each transfer's shapes from it).  With ``None`` or ``True``, a stage whose output
    shapes change while its inputs' do not (data-dependent shapes) fails the step on both
    ranks with an error naming the transfer and both shapes (never a silent mis-pairing);
    pass ``False`` for such models.  The dynamic order then applies among actions whose
    inputs are local or already arrived; a remote input not yet sent counts as ready only for
    the list's first pending action.

    gloo: ``None`` and ``True`` run the same protocol on CPU (headers through a gloo group for
    the first step of a layout, payloads through two-rank groups): after it the loop thread posts each
    peer's next ``gloo_prepost_depth`` payloads ahead and waits in gloo itself for the one its
    next action needs, one thread hop per transfer as in torch's runtime, watched by a thread
    that judges liveness meanwhile (``runtime/direct_wait.py``; a wait on a lost peer is broken
    by closing that pair); measured in ``benchmarks/RESULTS.md`` ("CPU host path, round 5": 2
    gloo ranks, every schedule's step below torch's).  After a failed step, the receives posted
    ahead that nobody will fill are handed to the exit guard (``transport/tensor.py``): a process
    ending on the uncaught failure exits with code 1 without finalizing them.  ``False`` keeps
    gloo's header protocol (headers posted ahead on receiver threads, every step).  Environment:
    ``PIPELOOM_STATIC_SHAPES`` (``auto``, ``1`` or ``0``)."""

    emulate_nccl_transport: bool = False
    """gloo, for tests: run the NCCL transfer protocol on CPU ranks (headers through a gloo group
    of their own, payloads through two-rank groups, received by the event loop when the header
    has landed or, with ``static_shapes``, without headers), so that the gloo test suite covers
    it.  The loop waits for each receive itself when its consumer runs, as torch's runtime
    does, watched by ``runtime/direct_wait.py`` (as with ``static_shapes=True`` on gloo).
    Not for jobs."""

    overlap_streams: bool | None = None
    """GPUs: one compute stream per local stage (True), so OVERLAP_F_B's forward and backward
    halves (two stages) run concurrently, or every stage on the caller's stream (False).
    ``None`` (default, auto): a stream per stage on a rank whose list has OVERLAP_F_B actions
    (DualPipeV) or W actions (ZBVZeroBubble, InterleavedZeroBubble: fillers beside another
    stage's work) or stages with expert parallelism (one stage's all-to-all beside another's
    compute), one stream elsewhere (Interleaved1F1B, LoopedBFS;
    ``schedules.dispatch.stage_streams``): where a rank's stages have nothing to run at once, a
    second stream only lets the device run one stage's kernels among another's, which slows the
    action a peer waits for where the kernels fill the GPU (2 x H200, GPT size l,
    Interleaved1F1B: 237.0-241.5 ms on one stream, 255.7-258.2 on two, torch 247.3-253.5;
    ZBVZeroBubble size l 326.8 on two, 344.4 on one; DualPipeV size l: two 4% faster).  A rank
    with a single stage (1F1B, GPipe) always runs it on the caller's stream: nothing to overlap.  Data parallelism
    uses the caller's stream, except with expert parallelism (whose all-to-alls must run on
    their stage's stream to overlap).  Environment: ``PIPELOOM_OVERLAP_STREAMS`` (``1``, ``0``
    or ``auto``)."""

    profile_ranges: bool = False
    """Run every action inside a ``torch.profiler.record_function`` range named ``PP:{action}``
    (``PP:0F3``, ``PP:(0F3;3B1)OVERLAP_F_B``, as torch's runtime names them), so a profiler's
    timeline says which action launched each kernel; the dispatcher's waits are ranges too
    (``PP:wait 1F3``: for the inputs of the action named, the list's head; ``PP:hold 1F3``:
    held by the GPU commit horizon) and so are the sends after an action (``PP:send``).  Off by default: a range costs a few
    microseconds of host time per action even with no profiler running.
    Environment: ``PIPELOOM_PROFILE_RANGES=1``."""

    overlap_collectives: bool = True
    """Data parallelism: run UNSHARD's all-gather and REDUCE_GRAD's reductions as events that
    overlap compute (True), or make each block the dispatcher until it has completed (False,
    the naive baseline).  Environment: ``PIPELOOM_OVERLAP_COLLECTIVES=0``."""

    fsdp_reduce: str = "auto"
    """FSDP gradient reduction: ``"auto"`` reduce-scatters asynchronously in pipeloom where the
    reduction is a plain average, ``"fsdp"`` always leaves it to FSDP2's own (synchronous on
    CPU) post-backward.  Environment: ``PIPELOOM_FSDP_REDUCE``."""

    cuda_graphs: bool = False
    """GPUs: replay each stage's forward and backward from CUDA graphs (``runtime/cuda_graphs.py``),
    so a stage costs the host one launch instead of one per kernel: for models whose kernels are
    short enough that the host's launches bound the step (many small microbatches, a small
    hidden size).  Captured between steps, after the first training step of an input layout,
    one forward/backward pair per microbatch the schedule keeps alive on the stage, plus one where
    ``host_overlap_backward`` may launch a backward beside the next forward (the memory of that
    many activations, held for the job's life); what cannot use a graph (another input
    layout, keyword arguments other than device tensors and constants (None, bool, int, float, str;
    another constant value is another layout), evaluation, a stage that cannot be captured, which warns once)
    runs eagerly as before.  The stage module must be a function of its inputs and parameters on
    the device (no host reads of tensor values, no Python state that changes between calls);
    parameters are updated in place (any ``torch.optim`` optimizer); one that is replaced drops
    the graphs until the next capture; warm-up and capture run the module on zero inputs (its
    buffers are restored).  A graphed stage's backward cannot be split: I/W schedules run its whole
    backward at I.  Not with FSDP or expert parallelism (their collectives run inside the stage), nor yet with
    data parallelism (not verified on GPUs); CUDA only (``ValueError`` otherwise).  Off by default.  Environment: ``PIPELOOM_CUDA_GRAPHS=1``."""

    cuda_graphs_loss: bool = False
    """With ``cuda_graphs``: capture the last stage's ``loss_fn`` in the same graph as its module, when
    the target is one tensor (one replay computes the output and the loss; the backward starts from
    the loss).  The loss function then falls under the graph's rules too: a function of the output
    and the target on the device, no Python state that changes between steps (a token count set
    each step, a scheduled weight), no side effects (it runs only at capture), no parameters of its
    own (an ``nn.Module`` loss with parameters or buffers keeps the loss eager; a closure or method
    reading parameters is not seen, and they would get no gradient).  Refused (``ValueError``) without
    ``cuda_graphs``.  A loss that
    cannot be captured leaves the module captured alone, with a warning.  Off by default: with it
    off, the loss runs eagerly after the module's replay, whatever it does (measured on 2 x H200,
    GPT size s: no difference in the graphed step, 79.3 against 79.7 ms; the loss's saved tensors
    stay in each slot's memory pool).  Environment: ``PIPELOOM_CUDA_GRAPHS_LOSS=1``."""

    @property
    def cold_stall_timeout(self) -> float:
        """The stall timeout in effect for a cold step (``first_step_stall_timeout`` resolved)."""
        v = self.first_step_stall_timeout
        return max(self.stall_timeout, v if v is not None else max(300.0, 10 * self.stall_timeout))

    def __post_init__(self) -> None:
        problems = []
        if self.backend not in (None, "gloo", "nccl"):
            problems.append(f"backend must be 'gloo', 'nccl' or None (got {self.backend!r})")
        for name in ("heartbeat_interval", "heartbeat_timeout", "stall_timeout", "setup_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                problems.append(f"{name} must be a positive number of seconds (got {v!r})")
        v = self.first_step_stall_timeout
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            problems.append(f"first_step_stall_timeout must be a positive number of seconds or None (got {v!r})")
        if isinstance(self.gloo_prepost_depth, bool) or not isinstance(self.gloo_prepost_depth, int) or self.gloo_prepost_depth < 1:
            problems.append(f"gloo_prepost_depth must be an int >= 1 (got {self.gloo_prepost_depth!r})")
        if isinstance(self.gloo_park_ms, bool) or not isinstance(self.gloo_park_ms, (int, float)) or not 0 <= self.gloo_park_ms <= 100:
            problems.append(f"gloo_park_ms must be a number of milliseconds in [0, 100] (got {self.gloo_park_ms!r})")
        if isinstance(self.gpu_commit_launches, bool) or not isinstance(self.gpu_commit_launches, (int, float)) or not self.gpu_commit_launches >= 0:
            problems.append(f"gpu_commit_launches must be a number >= 0 (got {self.gpu_commit_launches!r})")
        if isinstance(self.gpu_commit_ms, bool) or not isinstance(self.gpu_commit_ms, (int, float)) or not self.gpu_commit_ms >= 0:
            problems.append(f"gpu_commit_ms must be a number of milliseconds >= 0 (got {self.gpu_commit_ms!r})")
        if self.p2p_max_ctas is not None and (
            isinstance(self.p2p_max_ctas, bool) or not isinstance(self.p2p_max_ctas, int) or self.p2p_max_ctas < 1
        ):
            problems.append(f"p2p_max_ctas must be an int >= 1 or None (got {self.p2p_max_ctas!r})")
        if self.ep_max_ctas is not None and (
            isinstance(self.ep_max_ctas, bool) or not isinstance(self.ep_max_ctas, int) or self.ep_max_ctas < 1
        ):
            problems.append(f"ep_max_ctas must be an int >= 1 or None (got {self.ep_max_ctas!r})")
        if self.dispatch not in ("auto", "ready", "critical", "guarded"):
            problems.append(f"dispatch must be 'auto', 'ready', 'critical' or 'guarded' (got {self.dispatch!r}; deterministic=True runs the list order)")
        if self.static_shapes not in (None, True, False):
            problems.append(f"static_shapes must be None (auto), True or False (got {self.static_shapes!r})")
        if self.host_overlap_backward not in (None, True, False):
            problems.append(f"host_overlap_backward must be None (auto), True or False (got {self.host_overlap_backward!r})")
        if not isinstance(self.cuda_graphs, bool):
            problems.append(f"cuda_graphs must be True or False (got {self.cuda_graphs!r})")
        if not isinstance(self.cuda_graphs_loss, bool):
            problems.append(f"cuda_graphs_loss must be True or False (got {self.cuda_graphs_loss!r})")
        if self.cuda_graphs_loss is True and self.cuda_graphs is False:
            problems.append("cuda_graphs_loss=True needs cuda_graphs=True (it captures the last stage's loss in that stage's "
                            "CUDA graph; without graphs the loss always runs eagerly)")
        if not isinstance(self.defer_graph_teardown, bool):
            problems.append(f"defer_graph_teardown must be True or False (got {self.defer_graph_teardown!r})")
        if self.dp_buffers not in ("refuse", "replica0"):
            problems.append(f"dp_buffers must be 'refuse' or 'replica0' (got {self.dp_buffers!r})")
        if not isinstance(self.host_overlap_trial, bool):
            problems.append(f"host_overlap_trial must be True or False (got {self.host_overlap_trial!r})")
        if self.tied_weights not in ("sync", "refuse"):
            problems.append(f"tied_weights must be 'sync' or 'refuse' (got {self.tied_weights!r})")
        if self.fsdp_reduce not in ("auto", "fsdp"):
            problems.append(f"fsdp_reduce must be 'auto' or 'fsdp' (got {self.fsdp_reduce!r})")
        if problems:
            raise ValueError("RuntimeOptions: " + "; ".join(problems))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RuntimeOptions:
        """Options from the ``PIPELOOM_*`` variables (see :data:`ENV_VARS`), then ``overrides``.

        ``environ`` defaults to ``os.environ``; unset or empty variables keep the
        field's default.  A malformed value raises ``ValueError`` naming the
        variable and the value.
        """
        env = os.environ if environ is None else environ
        fields: dict[str, Any] = {}
        for var, (name, parse) in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or not raw.strip():
                continue
            try:
                fields[name] = parse(raw.strip())
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
        fields.update(overrides)
        return cls(**fields)


def parse_fields(text: str) -> dict[str, Any]:
    """``"name=value,name=value"`` (benchmark and tool flags) -> RuntimeOptions fields, typed.

    Each value is parsed by its field's declared type (bool, int, float, str,
    ``| None`` with ``none``); an unknown name or a malformed value raises
    ``ValueError`` naming it.
    """
    types = {f.name: str(f.type) for f in dataclasses.fields(RuntimeOptions)}
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or name not in types:
            raise ValueError(f"{item!r}: expected NAME=VALUE with NAME a RuntimeOptions field ({', '.join(sorted(types))})")
        kind = types[name]
        try:
            if "None" in kind and raw.lower() == "none":
                out[name] = None
            elif kind.startswith("bool"):
                out[name] = _flag(raw)
            elif kind.startswith("int"):
                out[name] = int(raw)
            elif kind.startswith("float"):
                out[name] = float(raw)
            else:
                out[name] = raw
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from None
    return out


def _flag(raw: str) -> bool:
    low = raw.lower()
    if low in _FALSE:
        return False
    if low in _TRUE:
        return True
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def _seconds(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None


def _auto_flag(raw: str) -> bool | None:
    if raw.lower() == "auto":
        return None
    try:
        return _flag(raw)
    except ValueError:
        raise ValueError(f"expected auto or one of {', '.join(_TRUE + _FALSE)}") from None


def _ms(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("expected a number of milliseconds") from None


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("expected a number") from None


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("expected an integer") from None


#: environment variable -> (field, parser); the one place the runtime reads its settings from the environment
ENV_VARS: dict[str, tuple[str, Any]] = {
    "PIPELOOM_BACKEND": ("backend", str),
    "PIPELOOM_HEARTBEAT_TIMEOUT": ("heartbeat_timeout", _seconds),
    "PIPELOOM_STALL_TIMEOUT": ("stall_timeout", _seconds),
    "PIPELOOM_FIRST_STEP_STALL_TIMEOUT": ("first_step_stall_timeout", _seconds),
    "PIPELOOM_TRACE": ("trace", str),
    "PIPELOOM_TRACE_ENDPOINT": ("trace_endpoint", str),
    "PIPELOOM_PAIR_GROUPS": ("pair_groups", _flag),
    "PIPELOOM_P2P_MAX_CTAS": ("p2p_max_ctas", _int),
    "PIPELOOM_BATCH_P2P": ("batch_p2p", _flag),
    "PIPELOOM_EP_MAX_CTAS": ("ep_max_ctas", _int),
    "PIPELOOM_GPU_COMMIT_MS": ("gpu_commit_ms", _ms),
    "PIPELOOM_GPU_COMMIT_LAUNCHES": ("gpu_commit_launches", _number),
    "PIPELOOM_GPU_EARLY_RECEIVES": ("gpu_early_receives", _flag),
    "PIPELOOM_OVERLAP_STREAMS": ("overlap_streams", _auto_flag),
    "PIPELOOM_STATIC_SHAPES": ("static_shapes", _auto_flag),
    "PIPELOOM_PROFILE_RANGES": ("profile_ranges", _flag),
    "PIPELOOM_GPU_COMMIT_RUNNING": ("gpu_commit_running", _flag),
    "PIPELOOM_GPU_LEARN_SLEEP": ("gpu_learn_sleep", _flag),
    "PIPELOOM_HOST_OVERLAP_BACKWARD": ("host_overlap_backward", _auto_flag),
    "PIPELOOM_HOST_QUEUE_BACKWARDS": ("host_queue_backwards", _flag),
    "PIPELOOM_HOST_OVERLAP_TRIAL": ("host_overlap_trial", _flag),
    "PIPELOOM_DP_BUFFERS": ("dp_buffers", str),
    "PIPELOOM_DEFER_GRAPH_TEARDOWN": ("defer_graph_teardown", _flag),
    "PIPELOOM_CUDA_GRAPHS_LOSS": ("cuda_graphs_loss", _flag),
    "PIPELOOM_OVERLAP_COLLECTIVES": ("overlap_collectives", _flag),
    "PIPELOOM_FSDP_REDUCE": ("fsdp_reduce", str),
    "PIPELOOM_CUDA_GRAPHS": ("cuda_graphs", _flag),
    "PIPELOOM_DISPATCH": ("dispatch", str),
}


def resolve_options(options: RuntimeOptions | None, **explicit: Any) -> RuntimeOptions:
    """``Pipeline``'s precedence: ``explicit`` values that are not None, over ``options``, over the environment.

    ``options=None`` reads the environment (:meth:`RuntimeOptions.from_env`);
    given options are used as they are, without reading it.
    """
    base = RuntimeOptions.from_env() if options is None else options
    if not isinstance(base, RuntimeOptions):
        raise TypeError(f"options must be a RuntimeOptions, not {type(base).__name__}")
    return dataclasses.replace(base, **{k: v for k, v in explicit.items() if v is not None})
