#!/usr/bin/env bash
# One device call's worth of GPU lanes, run concurrently, one lane per GPU:
#
#   bash scripts/gpu_device_session.sh "0=c7-engine-kernels c7-engine-kernels-moe" "1=kernels-moe"
#
# Installs the offline vLLM bundle first when /tmp/site lacks it (the parts already copied to
# /tmp/b by earlier calls, or lying in gpu_bundles/), then runs scripts/gpu_lane.sh once per
# "GPU=stages" argument with CUDA_VISIBLE_DEVICES set to that GPU (an argument "0,1=tp2-qwen3"
# gives a lane two GPUs; "1b=..." a second lane on GPU 1 - the letter only names it), each writing
# $OUT/gpu<tag>/{gpu-lane.tgz,lane-summary.txt}. A VAR=VALUE among the stages sets that lane's
# environment, e.g. "1b=CONFORMANCE_VLLM_ATTENTION_BACKEND=TRITON_ATTN kernels-qwen3".
# LANE_BUDGET_S (default 540) is each lane's budget.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/out/device}
mkdir -p /tmp/b "$OUT"
cp -n gpu_bundles/*.tar gpu_bundles/install.sh /tmp/b/ 2>/dev/null
if ! PYTHONPATH=/tmp/site python -c "import vllm" 2>/dev/null; then
  t0=$(date +%s)
  bash /tmp/b/install.sh /tmp/site > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 3; }
  echo "== vLLM bundle installed in $(( $(date +%s) - t0 ))s"
fi
pids=()
for spec in "$@"; do
  tag=${spec%%=*}; stages=${spec#*=}
  gpus=${tag//[a-z]/}
  tag=gpu${tag//,/-}
  echo "== lane $tag: $stages"
  ( names=()
    for tok in $stages; do
      if [[ $tok == *=* ]]; then export "$tok"; else names+=("$tok"); fi    # VAR=VALUE: this lane's environment
    done
    CUDA_VISIBLE_DEVICES=$gpus OUT="$OUT/$tag" RESULTS="/tmp/lane-$tag" bash scripts/gpu_lane.sh "${names[@]}" \
      > "/tmp/lane-$tag.console" 2>&1 ) &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
for f in "$OUT"/gpu*/lane-summary.txt; do echo "#### $f"; cat "$f"; done
exit $status
