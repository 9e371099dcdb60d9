#!/usr/bin/env bash
# Builds the CPU test environments for the version matrix (no CUDA stack, no NPU).
#
#   scripts/env.sh base           .matrix/base: CPU torch + vLLM's pure-Python deps (requirements/base.lock),
#                                 triton (for TRITON_INTERPRET=1), pytest, hypothesis, this package (editable)
#   scripts/env.sh PAIR           .matrix/PAIR: a venv layered on base (a .pth adds base's site-packages)
#                                 holding only vllm and vllm-ascend, installed with --no-deps
#   scripts/env.sh ascendc        .matrix/ascendc: triton-ascend + ascendnpu-ir (bishengir) + pytest from
#                                 requirements/ascendc.lock, for tests/ascend_compile; standalone (no base:
#                                 triton-ascend replaces upstream triton), Python 3.9-3.11
#
# PAIR is one of the names in scripts/pairs.txt. Re-running is cheap: a finished venv is kept
# (it records what it holds in .matrix/<name>/.done).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
root=${ALP_MATRIX_DIR:-$here/.matrix}
py=${PYTHON:-python3}
mkdir -p "$root"

pip_q() { "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}" 2>&1 | grep -v "^WARNING: Location" || true; }

build_base() {
  local venv=$root/base
  local want; want=$(cat requirements/base.lock setup.cfg pyproject.toml | sha1sum | cut -c1-12)
  if [ -f "$venv/.done" ] && [ "$(cat "$venv/.done")" = "$want" ]; then return; fi
  rm -rf "$venv"; "$py" -m venv "$venv"
  pip_q "$venv" -r requirements/base.lock
  pip_q "$venv" --no-deps 'xgrammar==0.2.9'
  pip_q "$venv" --no-deps -e .
  "$venv/bin/python" -c "import torch, triton, wrapt, hypothesis, ascend_layerwise_patch" \
    || { echo "base venv is broken" >&2; exit 1; }
  echo "$want" > "$venv/.done"
}

build_pair() {
  local name=$1 line vllm ascend
  line=$(grep -E "^$name[[:space:]]" scripts/pairs.txt) || { echo "unknown pair $name (see scripts/pairs.txt)" >&2; exit 2; }
  read -r _ vllm ascend _ <<<"$line"
  local venv=$root/$name want="vllm==$vllm vllm-ascend==$ascend"
  if [ -f "$venv/.done" ] && [ "$(cat "$venv/.done")" = "$want" ]; then return; fi
  rm -rf "$venv"; "$py" -m venv "$venv"
  local site base_site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  base_site=$("$root/base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # addsitedir (not a bare path) so base's own .pth files -- the editable install -- are processed.
  echo "import site; site.addsitedir('$base_site')" > "$site/_alp_base.pth"
  local pkgs=("vllm==$vllm")
  [ "$ascend" != "-" ] && pkgs+=("vllm-ascend==$ascend")
  pip_q "$venv" --no-deps "${pkgs[@]}"
  echo "$want" > "$venv/.done"
}

build_ascendc() {
  local venv=$root/ascendc
  local want; want=$(sha1sum requirements/ascendc.lock | cut -c1-12)
  if [ -f "$venv/.done" ] && [ "$(cat "$venv/.done")" = "$want" ]; then return; fi
  rm -rf "$venv"; "$py" -m venv "$venv"
  pip_q "$venv" --no-deps -r requirements/ascendc.lock
  "$venv/bin/python" -c "import triton.backends.ascend, ascendnpuir, pytest" \
    || { echo "ascendc venv is broken (triton-ascend has wheels for Python 3.9-3.11 only)" >&2; exit 1; }
  echo "$want" > "$venv/.done"
}

[ $# -eq 0 ] && set -- base
for name in "$@"; do
  case "$name" in
    base) build_base ;;
    ascendc) build_ascendc ;;
    *) build_base; build_pair "$name" ;;
  esac
done
