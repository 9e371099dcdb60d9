#!/usr/bin/env bash
# The main job from a fresh machine: build the primary pair's CPU environment (vLLM 0.25.1 +
# vllm-ascend 0.25.1rc1, NPU runtime stood in) and run the patch check against it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh v0251
exec .matrix/v0251/bin/python -m ascend_layerwise_patch check --cpu "$@"
