#!/usr/bin/env bash
# Maintainers' note - not needed by users. A user installs vLLM with pip in the GPU environment
# (`pip install "vllm==0.26.0" -e ".[test]"`, docs/gpu-lane.md) and runs plain pytest.
#
# This workplace's GPU machines are offline, so vLLM reaches them as a bundle of wheels
# (part-0N.tar + install.sh, built and kept outside this repository). This wrapper installs that
# bundle once, puts it on PYTHONPATH, sets the offline switches, then runs plain pytest with YOUR
# arguments - the suite runs the same with or without it:
#
#   bash scripts/gpu_lane.sh [--bundles DIR] [--site DIR] -- PYTEST-ARGS...
#
# --bundles DIR: the folder with part-0N.tar + install.sh; installed into --site (default
# /tmp/site) unless vLLM already imports from there. Whatever the implementation needs in the
# pytest process (VLLM_BATCH_INVARIANT) the suite sets itself at configure time and echoes in its
# header; nothing of that is exported here.
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
    echo "vLLM is not importable with PYTHONPATH=$PYTHONPATH: pip install vllm==0.26.0, or give --bundles DIR (part-0N.tar + install.sh)" >&2
    exit 2
  fi
  bash "$BUNDLES/install.sh" "$SITE"
fi
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m pytest "$@"
