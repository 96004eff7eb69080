#!/usr/bin/env bash
# The vLLM GPU lane: run ON THE H200 in one device call (at most 10 minutes), from the repository
# root, after the offline vLLM 0.26.0 bundle is installed:
#
#   bash gpu_bundles/install.sh /tmp/site          # once per machine (~1 min)
#   bash scripts/gpu_lane.sh [STAGE ...]            # default: c3c4-qwen3 c5-qwen3
#
# Stages: each a separate pytest run with its own report under $OUT. Every distinct EngineSettings
# is a new engine subprocess (equal ones are reused); an eager engine of a shallow proxy starts in
# ~15 s (about half of it Python + vLLM imports, overlapped by a pre-spawned worker). Times
# measured on one H200 on 2026-11-30 without the pre-spawned worker:
#   smoke          tests_meta/test_vllm_adapter.py: mappings, worker protocol (fake backend), and the
#                  real engine on small dense (V2 model runner) and MoE (V1 runner) models: chunking,
#                  preemption, graphs, prefix-cache hits are seen to engage. 10 engines; 385 s
#   c3c4-qwen3     gates C3 + C4, qwen3 shallow (real widths, 2 layers), with their controls. ~220 s
#                  (LANE_XDIST / LANE_GPU_PER_WORKER as for upto-qwen3)
#   c5-qwen3       gate C5, qwen3 shallow (11 engine configurations, one compiled). ~300 s
#   engines-qwen3  C3-C5 in one run. 522 s for 25 of its 26 checks: does not fit with anything else
#   c3c4-moe, c5-moe, engines-moe   the same for qwen3_moe shallow (vLLM's V1 model runner)
#   kernels-qwen3  C0 + C2 for vLLM's own kernels, qwen3 shallow (real widths): the engine's kernel
#                  inventory under the profiler, then each mapped kernel called directly at
#                  hypothesis-drawn token counts, VLLM_BATCH_INVARIANT=1, plus its =0 controls
#   kernels-moe    the same for qwen3_moe shallow (adds fused MoE and the router)
#   c7-engine-kernels  C6, C7 and C9 with the trainer on vLLM's own forward kernels (fixtures.vllm.trainer)
#                  and weights pushed through vLLM's reload path, qwen3 shallow: the headline
#                  train-inference parity check (213 s; C7 and C9 exactly 0 on the H200); c7-engine-kernels-moe: qwen3_moe
#   c7-transformers-backend  C7 with vLLM's Transformers backend (model_impl="transformers") engines
#                  against the same trainer: where the two implementations part, module by module
#   c7-full-dummy-qwen3  C7 at full depth with the engine-kernel trainer (weights files: the trainer
#                  needs them, so this is a files proxy despite the name's family)
#   tp2-qwen3      C3 + C4 with every engine at tensor parallel 2 (the 2-GPU kind; 293 s, all pass)
#   c7-tp2-qwen3   C7 with TP=2 engines against the engine-kernel trainer computing as vLLM's two ranks
#                  do (per-rank heads and MLP slices, row-parallel partials summed) on the first GPU
#   hybrid         C3 on nemotron_h shallow: vLLM refuses batch invariance for Mamba layers (red,
#                  with vLLM's reason); the stock-engine control shows what users get instead
#   hybrid-full-dummy  the same at full depth (52 layers of the Nemotron-3-Nano-30B-A3B-like recipe,
#                  engine-dummy weights): the refusal, and the stock engine's needle control
#   upto-qwen3     the verdict run: --upto C5 (C0..C2 on the trainer first), qwen3 shallow, -x
#                  (LANE_XDIST=N runs it on N pytest-xdist workers sharing the GPU; with
#                  LANE_GPU_PER_WORKER=1 worker gwN gets GPU N instead)
#   upto-moe       the same for qwen3_moe shallow
#   controls       only the negative controls (VLLM_BATCH_INVARIANT=0 engines must differ)
#   full-qwen3     full depth (36 layers; the 16 GB bf16 proxy is built on the CPU first, estimated
#                  1-2 min): needle, decode=prefill and same-batch checks plus their controls
#   full-dummy-qwen3, full-dummy-moe   the same at full depth with --proxy-weights engine-dummy:
#                  config only, vLLM draws its own seeded weights (load_format=dummy), so a full
#                  Qwen3-30B-A3B (61 GB in bf16) needs no weight files on the 64 GB disk (qwen3: 140 s;
#                  moe: its first engine start outlasted 290 s)
#
# Knobs (environment): OUT (where gpu-lane.tgz and lane-summary.txt go; the device call's $OUT),
# RESULTS (the working folder packed into it; default /tmp/gpu-lane-<time>), SITE (/tmp/site), LANE_BUDGET_S
# (seconds for all stages together, default 560: the rest of a 600 s call is for start-up and
# copying $OUT back), PER_TEST_TIMEOUT (300, needs pytest-timeout), PYTEST_X (-x; set to "" to go
# on after a failure), HYPOTHESIS_PROFILE (ci), CONFORMANCE_VLLM_IDLE_ENGINES (idle engine
# subprocesses kept for reuse: 4 shallow, 1 full), CONFORMANCE_VLLM_ATTENTION_BACKEND
# (FLASH_ATTN; TRITON_ATTN for the other backend), CONFORMANCE_VLLM_COMPILED_CUSTOM_OPS (unset: vLLM's
# choice, which swaps its custom ops for torch-native ones when compiling; "all" keeps them),
# CONFORMANCE_VLLM_LOG_DIR ($RESULTS/vllm-logs). Every pytest gets these four as --vllm-* options
# (the script unsets the variables, so an option is the only value pytest sees); the adapter's
# other CONFORMANCE_VLLM_* variables pass through as its environment fallback.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The device tool returns only a few files from $OUT: the lane works in RESULTS and packs it into
# $OUT/gpu-lane.tgz at the end (lane-summary.txt is also copied out on its own).
FINAL_OUT=${OUT:-$PWD/out/gpu-lane}
OUT=${RESULTS:-/tmp/gpu-lane-$(date +%s)}
mkdir -p "$FINAL_OUT"
SITE=${SITE:-/tmp/site}
BUDGET=${LANE_BUDGET_S:-560}
PER_TEST=${PER_TEST_TIMEOUT:-300}
X=${PYTEST_X--x}
mkdir -p "$OUT"

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# What vLLM reads at import time. The adapter sets these again in every engine subprocess, and
# VLLM_BATCH_INVARIANT there follows EngineSettings.batch_invariant (0 for the controls); exported
# here so the report header shows them.
export VLLM_BATCH_INVARIANT=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
# the vLLM adapter's knobs: this script's inputs, handed to every pytest as --vllm-* options
VLLM_LOG_DIR=${CONFORMANCE_VLLM_LOG_DIR:-$OUT/vllm-logs}
VLLM_BACKEND=${CONFORMANCE_VLLM_ATTENTION_BACKEND:-FLASH_ATTN}
VLLM_CUSTOM_OPS=${CONFORMANCE_VLLM_COMPILED_CUSTOM_OPS:-}
IDLE_SHALLOW=${CONFORMANCE_VLLM_IDLE_ENGINES:-4}
IDLE_FULL=${CONFORMANCE_VLLM_IDLE_ENGINES:-1}
unset CONFORMANCE_VLLM_LOG_DIR CONFORMANCE_VLLM_ATTENTION_BACKEND CONFORMANCE_VLLM_COMPILED_CUSTOM_OPS \
  CONFORMANCE_VLLM_IDLE_ENGINES

START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

{
  echo "== gpu lane $(date -u +%FT%TZ) stages: ${*:-c3c4-qwen3 c5-qwen3}"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | head -4
  python - <<'EOF'
import importlib.util, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available())
for name in ("vllm", "transformers", "pytest", "xdist", "hypothesis", "pytest_timeout"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(f"{name}: MISSING")
        continue
    try:
        from importlib.metadata import version
        print(f"{name}: {version(name.replace('_', '-') if name != 'xdist' else 'pytest-xdist')}")
    except Exception:
        print(f"{name}: present")
EOF
} 2>&1 | tee "$OUT/lane-env.txt"

if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  echo "vLLM is not importable with PYTHONPATH=$PYTHONPATH: run 'bash gpu_bundles/install.sh $SITE' first" | tee -a "$OUT/lane-env.txt"
  cp "$OUT/lane-env.txt" "$FINAL_OUT/"
  exit 2
fi
TIMEOUT_OPT=()
if python -c "import pytest_timeout" 2>/dev/null; then
  TIMEOUT_OPT=(--timeout="$PER_TEST")
else
  echo "pytest-timeout is not installed: no per-test timeout (the adapter's own timeouts still apply)" | tee -a "$OUT/lane-env.txt"
fi

status=0
run_stage() {   # name, then pytest arguments; IDLE=N before it: idle engines kept (default $IDLE_SHALLOW)
  local name=$1; shift
  local idle=${IDLE:-$IDLE_SHALLOW}
  local vllm_opts=(--vllm-log-dir="$VLLM_LOG_DIR" --vllm-attention-backend="$VLLM_BACKEND" --vllm-idle-engines="$idle")
  [[ -n "$VLLM_CUSTOM_OPS" ]] && vllm_opts+=(--vllm-compiled-custom-ops="$VLLM_CUSTOM_OPS")
  local budget; budget=$(left)
  if (( budget < 60 )); then
    echo "== $name: skipped, only ${budget}s of the lane budget left" | tee -a "$OUT/lane-summary.txt"
    return
  fi
  echo "== $name ($(date -u +%T), ${budget}s left, idle engines kept: $idle): pytest $* ${vllm_opts[*]}" \
    | tee -a "$OUT/lane-summary.txt"
  local t0; t0=$(date +%s)
  timeout --signal=TERM --kill-after=20 "$budget" \
    python -m pytest -p no:cacheprovider "${TIMEOUT_OPT[@]}" -ra --basetemp="/tmp/lane-$name" "$@" "${vllm_opts[@]}" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  (( rc != 0 )) && status=$rc
  echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/lane-summary.txt"
  grep -E "^(C[0-9]+ |gate  )|passed|failed|error" "$OUT/$name.log" | tail -25 | tee -a "$OUT/lane-summary.txt"
  rm -rf "/tmp/lane-$name"          # proxies are big; the disk is 64 GiB
}

ENGINE_GATES=(-m "C3 or C4 or C5")
model_of() { case $1 in *-moe) echo qwen3_moe ;; *) echo qwen3 ;; esac; }
XDIST=()
[[ -n "${LANE_XDIST:-}" ]] && XDIST=(-n "$LANE_XDIST")
[[ -n "${LANE_XDIST:-}" && -n "${LANE_GPU_PER_WORKER:-}" ]] && XDIST+=(--gpu-per-worker)
for stage in ${@:-c3c4-qwen3 c5-qwen3}; do
  model=$(model_of "$stage")
  case $stage in
    smoke)
      run_stage smoke tests_meta/test_vllm_adapter.py --impl vllm --durations=15 ;;
    c3c4-qwen3|c3c4-moe)
      run_stage "$stage" --impl vllm --proxy shallow --model="$model" -m "C3 or C4" --durations=15 \
        --report="$OUT/report-$stage" "${XDIST[@]}" ;;
    c5-qwen3|c5-moe)
      run_stage "$stage" --impl vllm --proxy shallow --model="$model" -m C5 --durations=15 --report="$OUT/report-$stage" ;;
    engines-qwen3|engines-moe)
      run_stage "$stage" --impl vllm --proxy shallow --model="$model" "${ENGINE_GATES[@]}" --durations=15 \
        --report="$OUT/report-$stage" ;;
    upto-qwen3|upto-moe)
      run_stage "$stage" --impl vllm --proxy shallow --model="$model" --upto C5 --durations=15 \
        --report="$OUT/report-$stage" $X "${XDIST[@]}" ;;
    kernels-qwen3|kernels-moe)
      run_stage "$stage" --impl vllm --proxy shallow --model="$model" --durations=10 \
        tests_c0_inventory/test_c0_engine_kernels.py tests_c5_invariance/test_c2_vllm_kernels.py \
        --report="$OUT/report-$stage" ;;
    c7-engine-kernels|c7-engine-kernels-moe)
      run_stage "$stage" --impl fixtures.vllm.implementation:engine_kernel_trainer --proxy shallow --model="$model" \
        -m "C6 or C7 or C9" --durations=10 --report="$OUT/report-$stage" ;;
    c7-transformers-backend)
      run_stage "$stage" --impl fixtures.vllm.implementation:transformers_backend --proxy shallow --model=qwen3 \
        -m C7 --durations=10 --report="$OUT/report-$stage" ;;
    c7-full-dummy-qwen3)
      IDLE=$IDLE_FULL run_stage "$stage" --impl fixtures.vllm.implementation:engine_kernel_trainer \
        --proxy full --model=qwen3 -m C7 --durations=10 --report="$OUT/report-$stage" ;;
    c7-tp2-qwen3)
      run_stage "$stage" --impl fixtures.vllm.implementation:tensor_parallel_2_engine_kernels --proxy shallow --model=qwen3 \
        -m C7 --durations=10 --report="$OUT/report-$stage" ;;
    tp2-qwen3)
      run_stage tp2-qwen3 --impl fixtures.vllm.implementation:tensor_parallel_2 --proxy shallow --model=qwen3 \
        -m "C3 or C4" --durations=10 --report="$OUT/report-tp2-qwen3" ;;
    hybrid)
      run_stage hybrid --impl vllm --proxy shallow --model=nemotron_h -m C3 --durations=10 \
        --report="$OUT/report-hybrid" ;;
    hybrid-full-dummy)
      IDLE=$IDLE_FULL run_stage "$stage" --impl vllm --proxy full --proxy-weights engine-dummy \
        --model=nemotron_h -m C3 -k "needle_alone_equals or control_stock" --durations=10 --report="$OUT/report-$stage" ;;
    controls)
      run_stage controls --impl vllm --proxy shallow --model=qwen3 "${ENGINE_GATES[@]}" -k "control" \
        --report="$OUT/report-controls-qwen3" ;;
    full-qwen3)
      IDLE=$IDLE_FULL run_stage full-qwen3 \
        --impl vllm --proxy full --model=qwen3 -m "C3 or C4" --durations=15 \
        -k "needle or same_batch_twice or decode_equals_prefill or control_stock" --report="$OUT/report-qwen3-full" ;;
    full-dummy-qwen3|full-dummy-moe)
      IDLE=$IDLE_FULL run_stage "$stage" \
        --impl vllm --proxy full --proxy-weights engine-dummy --model="$model" -m "C3 or C4" --durations=15 \
        -k "needle or same_batch_twice or decode_equals_prefill or control_stock" --report="$OUT/report-$stage" \
        "${XDIST[@]}" ;;
    *)
      echo "unknown stage $stage (smoke kernels-qwen3 kernels-moe c3c4-qwen3 c5-qwen3 engines-qwen3 c3c4-moe" \
           "c5-moe engines-moe upto-qwen3 upto-moe c7-engine-kernels c7-engine-kernels-moe c7-transformers-backend c7-full-dummy-qwen3 c7-tp2-qwen3 tp2-qwen3 hybrid" \
           "hybrid-full-dummy controls full-qwen3" \
           "full-dummy-qwen3 full-dummy-moe)" >&2
      exit 2 ;;
  esac
done
echo "== lane done in $(( $(date +%s) - START ))s, exit $status; reports and worker logs in $FINAL_OUT/gpu-lane.tgz" \
  | tee -a "$OUT/lane-summary.txt"
find "$OUT" -name "*.trace.json" -size +20M -delete 2>/dev/null   # profiler traces of full-depth runs
tar -czf "$FINAL_OUT/gpu-lane.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
cp "$OUT/lane-summary.txt" "$FINAL_OUT/"
exit $status
