#!/usr/bin/env bash
# Thin wrapper for an OFFLINE GPU machine: installs the vLLM bundle once, puts it on PYTHONPATH,
# sets the offline switches, then runs plain pytest with YOUR arguments. It is not another way to
# run the suite - the suite runs the same with or without it:
#
#   bash scripts/gpu_lane.sh [--bundles DIR] [--site DIR] -- PYTEST-ARGS...
#   bash scripts/gpu_lane.sh --bundles gpu_bundles -- --impl vllm-engine-kernels \
#        --model=/path/to/checkpoint --upto C10 -n 4 --report=out
#
# --bundles DIR: the folder with part-0N.tar + install.sh (../shared/gpu/make-bundles.sh builds
# them); installed into --site (default /tmp/site) unless vLLM already imports from there.
# Whatever the implementation needs in the pytest process (VLLM_BATCH_INVARIANT) the
# suite sets itself at configure time and echoes in its header; nothing of that is exported here.
set -euo pipefail
BUNDLES="" SITE=/tmp/site
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundles) BUNDLES=$2; shift 2 ;;
    --site) SITE=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--bundles DIR] [--site DIR] -- PYTEST-ARGS..." >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! python -c "import vllm" 2>/dev/null; then
  if [[ -z "$BUNDLES" ]]; then
    echo "vLLM is not importable with PYTHONPATH=$PYTHONPATH: give --bundles DIR (part-0N.tar + install.sh)" >&2
    exit 2
  fi
  bash "$BUNDLES/install.sh" "$SITE"
fi
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m pytest "$@"
