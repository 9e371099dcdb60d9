#!/usr/bin/env bash
# The main job from a fresh machine: build the primary pair's CPU environment (vLLM 0.25.1 +
# vllm-ascend 0.25.1rc1, NPU runtime stood in) and run the patch check against it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${ALP_MATRIX_DIR:-$PWD/.matrix}
echo "check.sh: building (or reusing) the CPU environment in $root: vLLM 0.25.1 + vllm-ascend 0.25.1rc1 from the package index"
start=$(date +%s)
bash scripts/env.sh v0251
echo "check.sh: running ascend-layerwise-patch check --cpu${*:+ $*} (imports vLLM and vllm-ascend with the NPU runtime stood in)"
rc=0
"$root/v0251/bin/ascend-layerwise-patch" check --cpu "$@" || rc=$?
echo "check.sh: exit $rc in $(( $(date +%s) - start )) s" >&2  # stderr: stdout stays check's (--json)
exit $rc
