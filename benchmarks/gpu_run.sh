#!/usr/bin/env bash
# The GPU session's script: install what the image lacks from carried wheels,
# then run the named parts, each bounded so a hang costs one part, not the call.
#
#   bash benchmarks/gpu_run.sh PART...       results under $OUT
#
# Parts:
#   tests      NCCL: tests/test_runtime_gradients.py (2-rank pool; 4-rank pool with >= 4 GPUs; TEST_VIS limits the GPUs)
#              and, with >= 4 GPUs, the PP x DP / PP x FSDP rank pool of tests/test_data_parallel.py (~430 s on 4 GPUs:
#              TEST_TIMEOUT; or split: tests2 = the 2-rank files, tests4 = the 4-rank pools)
#   verify     NCCL correctness of a commit in one call on 4 GPUs (session P: ~6 min on 4 x H200): tests2 on GPUs 0,1 beside
#              tests/test_cuda_graphs.py on GPU 2 and then the graphs-* rows of the 2-rank pool on GPUs 2,3; then tests4
#              (VERIFY_TIMEOUT bounds tests2, default 470 s; logs $OUT/nccl-tests-tests{2,4}.log, $OUT/graphs-{unit,nccl2}.log)
#   recheck    session W's NCCL rows (4 GPUs: run them first next time): tests/test_after_failure.py (its two rows that hung
#              inside dist.all_reduce, fixed in 0029ddb, unverified), the lifecycle rows of test_scaler_lifecycle_adversarial.py
#              (SIGSEGV in torch's split_group, fixed in 0029ddb, unverified), test_ties.py, test_checkpoint_robust.py; the 2-GPU
#              files on GPUs 0,1 and 2,3 at once; rank stacks (benchmarks/gpu_stacks) concatenated into $OUT/stacks.txt
#              (one file: a result holds few files); RECHECK_TIMEOUT bounds each file (default 200 s)
#   bench2     benchmarks/gpu_pipeline.py on GPUs VIS2 (0,1) for every schedule (+ varlen, + variants)
#   bench4     benchmarks/gpu_pipeline.py on 4 GPUs for every schedule
#   gpt2       benchmarks/gpu_pipeline.py --model gpt on GPUs VIS2 (0,1): sizes l and s (GPT_SIZES), schedules GPT_SCHEDULES
#              in one process per size, engines ENGINES (ENGINES_L for size l; e.g. pipeloom,torch,pipeloom-1s)
#              alternating in ALTERNATE rounds (default 3); 1F1B of size l profiled (--profile 3, traces of
#              ranks 0 and last under $OUT/prof-$CODE; NO_TRACES=1 keeps none, NO_PROFILE=1 skips); CODE tags rows
#   gpt4       the same on 4 GPUs, size l, no profile
#   shapes2    models the engine was not tuned on, beside torch on GPUs VIS2 (0,1): the plain transformer stage at
#              SHAPES (";"-separated gpu_pipeline.py argument sets; default a BERT-base-like 24 x 768 stack with 16
#              microbatches, a wide 8 x 4096 stack with long sequences, and the GPT of size s with a 128k vocabulary
#              head), schedules SHAPE_SCHEDULES, engines ENGINES, ALTERNATE rounds (default 3), no profile; rows in $OUT/gpu.jsonl
#   ceil2/ceil4  gpt2/gpt4 with engines pipeloom, torch and pipeloom with cuda_graphs (ALTERNATE, default 3; no profile):
#              each row's torch/sim, pipeloom/sim columns are the share of the schedule's simulated device ceiling
#              reached (session Q, 2 x H100: graphs 0.95-0.96 at size l on every schedule; ~5 min for both sizes)
#   streams2   benchmarks/gpu_pipeline.py --profile on GPUs VIS2: per rank, how long two stage streams ran kernels at once
#   p2p2       benchmarks/p2p_cost.py on GPUs VIS2: host us per NCCL post, standalone vs batched, flight recorder on/off
#   fsdp       benchmarks/gpu_fsdp.py, 2 pipeline ranks x 2 FSDP ranks
#   straggler  benchmarks/straggler.py on 4 GPUs
#   graphs     RuntimeOptions.cuda_graphs: the GPU unit tests and the graphs-* NCCL gradient rows, then the GPT with and without
#              graphs (GRAPHS_SIZES, default s; GPT_SCHEDULES) beside torch on 4 GPUs (2 without 4)
#   teardown   RuntimeOptions.defer_graph_teardown: the GPT (TEARDOWN_SIZES, default l) on 4 GPUs (2 without 4), schedules
#              GPT_SCHEDULES (default 1F1B,GPipe,Interleaved1F1B), pipeloom (deferred, the default) / torch / pipeloom
#              with defer_graph_teardown=false, ALTERNATE rounds (default 4); session O (4 x H100, 2 rounds): 1F1B
#              1.011 against 1.035 of torch, GPipe 1.003 against 1.017
#   moe4       benchmarks/gpu_moe.py on 4 GPUs (pp 2 x ep 2): DualPipeV with / without overlap (also (F;I) pairs, CTA cap), torch's DualPipeV,
#              1F1B, Interleaved1F1B; rank 0's profiler traces under $OUT/prof-moe; then tests/test_moe.py on NCCL
#              (MOE_ARGS: extra arguments, e.g. --engines; MOE_TIMEOUT: the benchmark's bound, default 240 s; the tests: MOE_TEST_TIMEOUT, default 200 s (session M: 16 of 17 in 110 s),
#              MOE_TESTS=0 skips them)
#   uneven2    benchmarks/uneven.py on GPUs VIS2 (0,1) (uneven4: 0..3): GPT size UNEVEN_SIZE (default s), schedules
#              UNEVEN_SCHEDULES, workloads UNEVEN_WORKLOADS (lengths fixed/uniform/bimodal/longtail, rank 1 jittered),
#              rules UNEVEN_RULES (default auto,aa: aa is the A/A control, a second deterministic pipeline; session R
#              on 4 x H100 measured two identical list-order pipelines -1.2..-4.3% apart: read gains against it),
#              pipeloom deterministic vs those vs torch, with the simulated gain and ceiling
#              next to each measured gain; rows in $OUT/uneven.jsonl, table in $OUT/uneven-table.md
#   tunegrid   benchmarks/tune_grid.py on GPUs VIS2 (0,1): profiling runs of the GPT (size s; Interleaved1F1B m=16,
#              blocks 2,1,3,2; traced with and without device syncs, then untraced), `pipeloom schedule tune`'s
#              ranking (with a layer-split search), then a measured grid of >= 15 configurations (5 schedules x
#              microbatches 8,16,32 + the tuner's splits): measured vs predicted by the two-lane model (host commits
#              ahead of the device; the tuner's default) and beside it the one-lane "max" model, the pick of each vs
#              the best, and variants of the two-lane model (fixed 10 ms horizon; device time = the synced span;
#              one device lane instead of a stream per stage; host time shared by FLOPs, the rule before host_fit;
#              lanes-inline: every backward launched inline, the model before it knew of host_overlap_backward,
#              which the grid runs with (auto, the default) and the tuner predicts since session J);
#              the tuner's host fit (fixed + per layer, embedding, head) and each row's modelled busy time per rank
#              (about 100 s; TUNE_ARGS="--device-model max" makes the old model pick; "--trace-grid" traces the grid
#              and prints each row's traced host and device busy time per rank beside the model's);
#              TUNE_ARGS adds arguments, TUNE_TIMEOUT bounds it (default 300 s); JSON in $OUT/tunegrid/tune_grid.json;
#              each rank bound to its own CPUs (--cpu-pin; TUNE_PIN= runs it free): session M, free 24.5% largest error
#              and the pick +21.5% from the best, bound 18.2% and +1.8% (the round-to-round spread 11% -> 5%);
#              run it alone on its host (the model is host-bound: a job on the other GPUs put the predictions 15-40% under)
#   tunemodes  issue 13: the searched split 1F1B m=8 (5,3) against (4,4) alone (the pair and the profiled configuration
#              alive, not the whole grid), 6 rounds + 8 head-to-head blocks, three times: free, each rank pinned to its
#              half of the CPUs (--cpu-pin), free and traced (--trace-grid: $OUT/tunemodes-trace/grid0N.jsonl for
#              `pipeloom trace summary`); whether (5,3)'s slow blocks (+25-35% in session I, fast ones beat (4,4)) follow
#              the many pipelines alive, the OS's placement of the host threads, or neither (about 3 x 50 s;
#              TUNEMODES_TIMEOUT bounds each, default 150 s); tables in $OUT/tunemodes-{free,pin,trace}.txt
# Environment: SCHEDULES, BENCH_ARGS, BENCH_TIMEOUT, VARIANTS (see bench2).  VIS2: the GPUs of the 2-GPU parts
# (default 0,1) and PORT: torchrun's rendezvous port (default 29500), so that two invocations can share a
# 4-GPU host (e.g. VIS2=2,3 PORT=29600 SKIP_INSTALL=1 for the second; each its own OUT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# the project itself, built as pyproject.toml maps it (the image has setuptools)
rm -rf /tmp/site/pipeloom /tmp/site/pipeloom-*; python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1  # (--upgrade: a warm machine keeps the last call's copy otherwise)
fi
VIS2=${VIS2:-0,1}
PORT=${PORT:-29500}
export PYTHONPATH=/tmp/site
REPO=$PWD
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
(cd /tmp && python3 -c "import torch, zmq, pipeloom.runtime; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'zmq', zmq.__version__)")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ALL="1F1B Interleaved1F1B ZBVZeroBubble DualPipeV GPipe LoopedBFS InterleavedZeroBubble"
T=${BENCH_TIMEOUT:-120}

variants() {  # variants WHAT X_OPTIONS SIZES SCHEDULES ROUNDS CODE: the GPT beside torch and a pipeloom-x variant
  local what=$1 xopts=$2 sizes=$3 scheds=$4 rounds=$5 code=$6 n=2 vis=$VIS2 size
  [ "$GPUS" -ge 4 ] && { n=4; vis=0,1,2,3; }
  for size in $sizes; do
    echo "== $n GPUs gpt-$size, $what"
    CUDA_VISIBLE_DEVICES=$vis bench $n "" --model gpt --size "$size" --schedule "$scheds" \
      --engines pipeloom,torch,pipeloom-x --x-options "$xopts" --alternate "$rounds" --code "$code"
  done
}

bench() {  # bench NPROC LABEL EXTRA_ARGS... (env for the run comes from the caller)
  local n=$1 label=$2; shift 2
  (cd /tmp && timeout "$T" torchrun --master-port "$PORT" --nproc-per-node "$n" "$REPO/benchmarks/gpu_pipeline.py" --json "$OUT/gpu.jsonl" \
     --label "$label" ${BENCH_ARGS:-} "$@" 2>&1 | grep -v "^\[W\|Warning\|warn" | cut -c1-400 | tail -${BENCH_TAIL:-3})
}

for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
  tests|tests2|tests4)
    # from outside the checkout, so the installed package (not ./pipeloom) is imported
    # (at 83c2762 on 4 x H200: test_runtime_gradients.py 2- and 4-rank pools ~300 s, the PP x DP pool ~130 s:
    # tests2 = the 2-rank files, tests4 = the 4-rank pools, tests = both, each within one call;
    # on 4 x H100 (session G) about 1.7x slower: tests2 > 330 s, tests4 ~420 s: TEST_TIMEOUT=560, one part per call)
    files="$REPO/tests/test_runtime_gradients.py $REPO/tests/test_static_shapes.py $REPO/tests/test_harness.py $REPO/tests/test_trace_device.py $REPO/tests/test_iw_adversarial.py"
    kexpr="not dead_rank and not user_error"
    [ "$part" = tests2 ] && kexpr="$kexpr and not four_ranks"
    if [ "$GPUS" -ge 4 ] && [ "$part" != tests2 ]; then files="$files $REPO/tests/test_data_parallel.py"; fi
    [ "$part" = tests4 ] && files="$REPO/tests/test_runtime_gradients.py $REPO/tests/test_data_parallel.py" && kexpr="$kexpr and (four_ranks or replicas or data_parallel or collectives or reduce or fsdp or buckets or unshard or events)"
    files=${TEST_FILES:-$files}
    # the fault tests spawn ranks that pick NCCL on a GPU host; they are gloo tests
    (cd /tmp && env ${TEST_VIS:+CUDA_VISIBLE_DEVICES=$TEST_VIS} PIPELOOM_TEST_BACKEND=nccl timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
       -c "$REPO/pyproject.toml" -rf $files -k "$kexpr" 2>&1 > "$OUT/nccl-tests-$part.log"; tail -15 "$OUT/nccl-tests-$part.log")
    ;;
  verify)
    if [ "$GPUS" -lt 4 ]; then echo "verify needs 4 GPUs (found $GPUS): run tests2 and graphs instead"; continue; fi
    (SKIP_INSTALL=1 TEST_VIS=0,1 TEST_TIMEOUT=${VERIFY_TIMEOUT:-470} bash "$REPO/benchmarks/gpu_run.sh" tests2 > "$OUT/verify-tests2.out" 2>&1) &
    ( cd /tmp && CUDA_VISIBLE_DEVICES=2 timeout 120 python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
        -rf "$REPO/tests/test_cuda_graphs.py" > "$OUT/graphs-unit.log" 2>&1
      CUDA_VISIBLE_DEVICES=2,3 PIPELOOM_TEST_BACKEND=nccl PIPELOOM_TEST_CASES=graphs timeout 200 python3 -m pytest -q -p no:cacheprovider \
        --rootdir "$REPO" -c "$REPO/pyproject.toml" -rf "$REPO/tests/test_runtime_gradients.py" -k two_ranks > "$OUT/graphs-nccl2.log" 2>&1 ) &
    wait
    echo "-- cuda graphs unit"; tail -2 "$OUT/graphs-unit.log"; echo "-- graphs rows (2 ranks)"; tail -2 "$OUT/graphs-nccl2.log"
    echo "-- tests2"; tail -3 "$OUT/verify-tests2.out"
    SKIP_INSTALL=1 TEST_TIMEOUT=${VERIFY4_TIMEOUT:-400} bash "$REPO/benchmarks/gpu_run.sh" tests4 2>&1 | tail -3
    ;;
  recheck)
    mkdir -p /tmp/stacks; rm -f /tmp/stacks/*
    rc() {  # rc VIS TAG FILE [pytest args]
      local vis=$1 tag=$2; shift 2
      (cd /tmp && PIPELOOM_TEST_FORK=0 PYTHONPATH="$REPO/benchmarks/gpu_stacks:$PYTHONPATH" PL_DUMP_DIR=/tmp/stacks PL_TAG=$tag \
         PL_DUMP_AFTER=${PL_DUMP_AFTER:-80} CUDA_VISIBLE_DEVICES=$vis timeout "${RECHECK_TIMEOUT:-200}" python3 -m pytest -v -p no:cacheprovider \
         --rootdir "$REPO" -c "$REPO/pyproject.toml" --tb=short -rf "$@" > "$OUT/recheck-$tag.log" 2>&1; echo "rc=$?" >> "$OUT/recheck-$tag.log")
    }
    ( rc 0,1 after "$REPO/tests/test_after_failure.py"; rc 0,1 ties "$REPO/tests/test_ties.py" ) &
    ( rc 2,3 ckpt "$REPO/tests/test_checkpoint_robust.py" ) &
    wait
    rc 0,1,2,3 lifecycle "$REPO/tests/test_scaler_lifecycle_adversarial.py" -k "test_lifecycle or test_launcher"
    for f in "$OUT"/recheck-*.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$f" | sed 's/.*:://' | cut -c1-160; done
    for f in /tmp/stacks/*; do [ -s "$f" ] && { echo "=== $f"; cat "$f"; }; done > "$OUT/stacks.txt" 2>/dev/null
    ;;
  bench2)
    for s in ${SCHEDULES:-$ALL}; do echo "== 2 GPUs $s"; CUDA_VISIBLE_DEVICES=$VIS2 bench 2 "" --schedule "$s"; done
    for s in 1F1B ZBVZeroBubble; do echo "== 2 GPUs $s varlen"; CUDA_VISIBLE_DEVICES=$VIS2 bench 2 "" --schedule "$s" --varlen; done
    # variants: "LABEL:ENV=VALUE:SCHEDULE" each
    for v in ${VARIANTS:-}; do
      IFS=: read -r label envset sched <<< "$v"
      echo "== 2 GPUs $sched $label"; (export CUDA_VISIBLE_DEVICES=$VIS2 "$envset"; bench 2 "$label" --schedule "$sched")
    done
    ;;
  shapes2)
    IFS=';' read -r -a shapes <<< "${SHAPES:---layers 24 --hidden 768 --heads 12 --seq 512 --microbatches 16 --mbsize 4;--layers 8 --hidden 4096 --heads 32 --seq 2048 --microbatches 8 --mbsize 1;--model gpt --size s --vocab 128000}"
    for sh in "${shapes[@]}"; do
      echo "== 2 GPUs $sh"
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=$VIS2 bench 2 "" $sh --schedule "${SHAPE_SCHEDULES:-1F1B,GPipe,Interleaved1F1B,ZBVZeroBubble,DualPipeV}" \
        --engines "${ENGINES:-pipeloom,torch}" --alternate "${ALTERNATE:-3}" --code "${CODE:-shapes}"
    done
    python3 "$REPO/benchmarks/gpu_pipeline.py" --table "$OUT/gpu.jsonl" | tee "$OUT/shapes-table.md"
    ;;
  ceil2|ceil4)
    ENGINES=pipeloom,torch,pipeloom-x NO_PROFILE=1 CODE=${CODE:-ceil} BENCH_TIMEOUT=${BENCH_TIMEOUT:-240} \
      BENCH_ARGS="--x-options cuda_graphs=true ${BENCH_ARGS:-}" SKIP_INSTALL=1 bash "$REPO/benchmarks/gpu_run.sh" "gpt${part#ceil}"
    ;;
  gpt2|gpt4)
    n=2; vis=$VIS2; [ "$part" = gpt4 ] && { n=4; vis=0,1,2,3; }
    gs=${GPT_SCHEDULES:-1F1B,GPipe,Interleaved1F1B,ZBVZeroBubble,DualPipeV}
    for size in ${GPT_SIZES:-l s}; do
      prof=""
      if [ "$part" = gpt2 ] && [ "$size" = l ] && [ -z "${NO_PROFILE:-}" ]; then
        prof="--profile 3"; [ -z "${NO_TRACES:-}" ] && prof="$prof --profile-dir $OUT/prof-${CODE:-x}"
      fi
      eng=${ENGINES:-pipeloom,torch}; [ "$size" = l ] && eng=${ENGINES_L:-$eng}
      echo "== $n GPUs gpt-$size $gs ($eng)"
      CUDA_VISIBLE_DEVICES=$vis bench $n "" --model gpt --size $size --schedule "$gs" --engines "$eng" \
        --alternate "${ALTERNATE:-3}" $prof --code "${CODE:-}"
    done
    ;;
  streams2)
    # how long two stage streams' kernels run side by side on a rank (concurrent_streams_us, kernel_us_by_stream
    # per rank in $OUT/streams.jsonl): GPT size STREAMS_SIZE (default s), pipeloom (ENGINES to add torch), profiled
    (cd /tmp && CUDA_VISIBLE_DEVICES=$VIS2 timeout "${STREAMS_TIMEOUT:-200}" torchrun --master-port "$PORT" --nproc-per-node 2 \
       "$REPO/benchmarks/gpu_pipeline.py" --json "$OUT/streams.jsonl" --model gpt --size "${STREAMS_SIZE:-s}" \
       --schedule "${STREAMS_SCHEDULES:-1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV}" --engines "${ENGINES:-pipeloom}" \
       --profile 2 --profile-schedules "${STREAMS_SCHEDULES:-1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV}" \
       2>&1 | grep -v "^\[W\|Warning\|warn" | cut -c1-300 | tail -8)
    python3 - "$OUT/streams.jsonl" <<'PY' | tee "$OUT/streams.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    for k, g in enumerate(r.get("gaps_by_rank") or []):
        print(r["engine"], r["schedule"], "rank", k, "step_ms", round(r.get("step_ms", 0), 2), "busy_us", round(g["busy_us"]),
              "span_us", round(g["span_us"]), "concurrent_us", g.get("concurrent_streams_us"), "by_stream", g.get("kernel_us_by_stream"))
PY
    ;;
  p2p2)
    # the host's cost of posting an NCCL send/recv: standalone (the runtime's), batched (torch's), with a poll per post;
    # then again without NCCL's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE=0)
    for fr in "" 0; do
      (cd /tmp && env CUDA_VISIBLE_DEVICES=$VIS2 ${fr:+TORCH_NCCL_TRACE_BUFFER_SIZE=$fr} timeout 120 torchrun --master-port "$PORT" \
         --nproc-per-node 2 "$REPO/benchmarks/p2p_cost.py" --json "$OUT/p2p.jsonl" 2>&1 | grep -v "^\[W\|Warning\|warn\|^W11\|\*\*\*" | tail -5)
    done
    ;;
  bench4)
    for s in ${SCHEDULES4:-$ALL}; do echo "== 4 GPUs $s"; bench 4 "" --schedule "$s"; done
    ;;
  fsdp)
    for s in ${FSDP_SCHEDULES:-1F1B Interleaved1F1B ZBVZeroBubble}; do
      echo "== fsdp 2x2 $s"
      (cd /tmp && timeout "$T" torchrun --master-port "$PORT" --nproc-per-node 4 "$REPO/benchmarks/gpu_fsdp.py" --schedule "$s" --json "$OUT/fsdp.jsonl" \
         2>&1 | grep -v "^\[W\|Warning\|warn" | tail -5)
    done
    python3 benchmarks/gpu_fsdp.py --table "$OUT/fsdp.jsonl" | tee "$OUT/fsdp-table.md"
    ;;
  straggler)
    (cd /tmp && timeout "${STRAGGLER_TIMEOUT:-200}" python3 "$REPO/benchmarks/straggler.py" --backend nccl --ranks 4 \
       --json "$OUT/straggler.jsonl" ${STRAGGLER_ARGS:-} 2>&1 | grep -v "^\[W\|Warning\|warn" | tail -30 | tee "$OUT/straggler.txt")
    ;;
  graphs)
    # RuntimeOptions.cuda_graphs: tests/test_cuda_graphs.py on one GPU beside the graphs-* rows of the 2-rank NCCL gradient
    # pool (then the 4-rank rows with >= 4 GPUs), then GPT sizes GRAPHS_SIZES (default s) on 4 GPUs (2 without 4),
    # schedules GPT_SCHEDULES, pipeloom / torch / pipeloom with graphs (session N: about 150 s for the tests)
    (cd /tmp && CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
       -rf "$REPO/tests/test_cuda_graphs.py" > "$OUT/graphs-unit.log" 2>&1) &
    gv=1,2; [ "$GPUS" -ge 4 ] && gv=2,3
    (cd /tmp && CUDA_VISIBLE_DEVICES=$gv PIPELOOM_TEST_BACKEND=nccl PIPELOOM_TEST_CASES=graphs timeout 150 python3 -m pytest -q -p no:cacheprovider \
       --rootdir "$REPO" -c "$REPO/pyproject.toml" -rf "$REPO/tests/test_runtime_gradients.py" -k two_ranks > "$OUT/graphs-nccl2.log" 2>&1) &
    wait
    tail -3 "$OUT/graphs-unit.log"; tail -3 "$OUT/graphs-nccl2.log"
    if [ "$GPUS" -ge 4 ]; then
      (cd /tmp && PIPELOOM_TEST_BACKEND=nccl PIPELOOM_TEST_CASES=graphs timeout 150 python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
         -c "$REPO/pyproject.toml" -rf "$REPO/tests/test_runtime_gradients.py" -k four_ranks > "$OUT/graphs-nccl4.log" 2>&1; tail -3 "$OUT/graphs-nccl4.log")
    fi
    variants "with and without cuda_graphs" cuda_graphs=true "${GRAPHS_SIZES:-s}" \
      "${GPT_SCHEDULES:-1F1B,Interleaved1F1B,GPipe,DualPipeV,ZBVZeroBubble}" "${ALTERNATE:-3}" "${CODE:-graphs}"
    ;;
  teardown)
    variants "graph teardown deferred or not" defer_graph_teardown=false "${TEARDOWN_SIZES:-l}" \
      "${GPT_SCHEDULES:-1F1B,GPipe,Interleaved1F1B}" "${ALTERNATE:-4}" "${CODE:-teardown}"
    ;;
  moe4)
    (cd /tmp && timeout "${MOE_TIMEOUT:-240}" torchrun --master-port "$PORT" --nproc-per-node 4 "$REPO/benchmarks/gpu_moe.py" --json "$OUT/moe.jsonl" \
       --profile-dir "$OUT/prof-moe" ${MOE_ARGS:-} 2>&1 | grep -v "^\[W\|Warning\|warn\|USDT" | cut -c1-700 | tail -14)
    python3 benchmarks/gpu_moe.py --table "$OUT/moe.jsonl" | tee "$OUT/moe-table.md"
    [ "${MOE_TESTS:-1}" = 1 ] && (cd /tmp && PIPELOOM_TEST_BACKEND=nccl timeout ${MOE_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
       -c "$REPO/pyproject.toml" "$REPO/tests/test_moe.py" 2>&1 > "$OUT/moe-nccl-tests.log"; tail -8 "$OUT/moe-nccl-tests.log")
    ;;
  uneven2|uneven4)
    n=2; vis=$VIS2; [ "$part" = uneven4 ] && { n=4; vis=0,1,2,3; }
    (cd /tmp && CUDA_VISIBLE_DEVICES=$vis timeout "${UNEVEN_TIMEOUT:-230}" python3 "$REPO/benchmarks/uneven.py" --backend nccl --ranks $n \
       --model gpt --size "${UNEVEN_SIZE:-s}" --schedules "${UNEVEN_SCHEDULES:-GPipe,1F1B,ZBVZeroBubble,InterleavedZeroBubble}" \
       --workloads "${UNEVEN_WORKLOADS:-fixed,uniform,bimodal,longtail,jitter}" --rules "${UNEVEN_RULES:-auto,aa}" \
       --steps "${UNEVEN_STEPS:-12}" --blocks "${UNEVEN_STEPS:-12}" --warmup 3 --timeout 225 --json "$OUT/uneven.jsonl" ${UNEVEN_ARGS:-} \
       2>&1 | grep -v "^\[W\|Warning\|warn" | cut -c1-300 | tail -40 | tee "$OUT/uneven-$n.txt")
    python3 benchmarks/uneven.py --table "$OUT/uneven.jsonl" | tee "$OUT/uneven-table.md"
    ;;
  tunegrid)
    (cd /tmp && CUDA_VISIBLE_DEVICES=$VIS2 timeout "${TUNE_TIMEOUT:-300}" torchrun --master-port "$PORT" --nproc-per-node 2 "$REPO/benchmarks/tune_grid.py" \
       --out "$OUT/tunegrid" ${TUNE_PIN---cpu-pin} ${TUNE_ARGS:-} 2>&1 | grep -v "^\[W\|Warning\|warn" | cut -c1-400 | tail -40 | tee "$OUT/tunegrid.txt")
    ;;
  tunemodes)
    for mode in free pin trace; do
      case $mode in free) extra="" ;; pin) extra="--cpu-pin" ;; trace) extra="--trace-grid" ;; esac
      (cd /tmp && CUDA_VISIBLE_DEVICES=$VIS2 timeout "${TUNEMODES_TIMEOUT:-150}" torchrun --master-port "$PORT" --nproc-per-node 2 \
         "$REPO/benchmarks/tune_grid.py" --names 1F1B --microbatches 8 --also-split 5,3 --rounds 6 --final-rounds 8 $extra \
         --out "$OUT/tunemodes-$mode" ${TUNE_ARGS:-} 2>&1 | grep -v "^\[W\|Warning\|warn" | cut -c1-400 | tail -32 | tee "$OUT/tunemodes-$mode.txt")
    done
    ;;
  *) echo "unknown part $part"; exit 2 ;;
  esac
done
if [ -f "$OUT/gpu.jsonl" ]; then python3 benchmarks/gpu_pipeline.py --table "$OUT/gpu.jsonl" | tee "$OUT/table.md"; fi
echo "=== done $(date +%T)"
