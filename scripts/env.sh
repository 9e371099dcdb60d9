#!/usr/bin/env bash
# Builds the CPU test environments for the version matrix (no CUDA stack, no NPU).
#
#   scripts/env.sh base           .matrix/base: CPU torch + vLLM's pure-Python deps (requirements/base.lock),
#                                 triton (for TRITON_INTERPRET=1), pytest, hypothesis, this package (editable)
#   scripts/env.sh PAIR           .matrix/PAIR: a venv layered on base (a .pth adds base's site-packages)
#                                 holding only vllm and vllm-ascend, installed with --no-deps, and this
#                                 package (editable), so its console script `ascend-layerwise-patch` is
#                                 the one the README tells users to run
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

say() { echo "env: $*"; }
# pip's own progress lines on a terminal, quiet otherwise (CI logs)
quiet=-q; [ -t 1 ] && quiet=
pip_q() { "$1/bin/python" -m pip install $quiet --disable-pip-version-check "${@:2}" 2>&1 | grep -v "^WARNING: Location" || true; }
# this package, editable, with its console script, into a pair venv; base's setuptools builds it
# (no download; base first on the path, ahead of the old setuptools that venv puts in every venv)
install_self() {
  local base_site; base_site=$("$root/base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  PYTHONPATH="$base_site" pip_q "$1" --no-deps --no-build-isolation -e "$here"
  [ -x "$1/bin/ascend-layerwise-patch" ] || { echo "env: installing this package into $1 failed" >&2; exit 1; }
}

build_base() {
  local venv=$root/base
  local want; want=$(cat requirements/base.lock setup.cfg pyproject.toml | sha1sum | cut -c1-12)
  if [ -f "$venv/.done" ] && [ "$(cat "$venv/.done")" = "$want" ]; then say "base: ready ($venv)"; return; fi
  say "base: creating $venv (CPU torch, vLLM's pure-Python dependencies, triton, pytest; 2.4 GB on disk)"
  rm -rf "$venv"; "$py" -m venv "$venv"
  say "base: installing requirements/base.lock"
  pip_q "$venv" -r requirements/base.lock
  pip_q "$venv" --no-deps 'xgrammar==0.2.9'
  say "base: installing this package (editable)"
  pip_q "$venv" --no-deps -e .
  "$venv/bin/python" -c "import torch, triton, wrapt, hypothesis, ascend_layerwise_patch" \
    || { echo "base venv is broken" >&2; exit 1; }
  echo "$want" > "$venv/.done"
  say "base: ready"
}

# vllm-ascend 0.27 and later ship only an sdist whose build requirements pin triton-ascend==3.2.2 (not on
# the index), so a plain install fails; built here without isolation and without its custom kernels
# (SOC_VERSION spares its setup the npu-smi query). The sdist is downloaded once into $root/.sdist.
sdist_only() { [ "$(printf '%s\n' "$1" 0.27 | sort -V | head -1)" = 0.27 ]; }
install_ascend_sdist() {
  local venv=$1 ver=$2 dl=$root/.sdist
  mkdir -p "$dl"
  local tgz; tgz=$(ls "$dl"/vllm_ascend-"$ver".tar.gz "$dl"/vllm-ascend-"$ver".tar.gz 2>/dev/null | head -1 || true)
  pip_q "$venv" setuptools wheel setuptools_scm
  if [ -z "$tgz" ]; then
    # --no-build-isolation: pip prepares the sdist's metadata here too, and in isolation it would
    # try to install every build requirement (torch-npu, triton-ascend==3.2.2, ...)
    SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 "$venv/bin/python" -m pip download $quiet \
      --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation \
      -d "$dl" "vllm-ascend==$ver" 2>&1 | grep -v "^WARNING: Location" || true
    tgz=$(ls "$dl"/vllm_ascend-"$ver".tar.gz "$dl"/vllm-ascend-"$ver".tar.gz 2>/dev/null | head -1 || true)
  fi
  [ -n "$tgz" ] || { echo "env: could not download the vllm-ascend $ver sdist" >&2; exit 1; }
  SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 pip_q "$venv" --no-deps --no-build-isolation "$tgz"
  "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-ascend') == '$ver'" \
    || { echo "env: installing vllm-ascend $ver from $tgz failed" >&2; exit 1; }
}

# MemCache (memcache-hybrid + memfabric-hybrid), as the pair's vllm-ascend asks for it: the version it
# pins, else requirements/memcache.lock's. The pool harness runs on it (tests/standins/memcache_host).
install_memcache() {
  local venv=$1 pins
  pins=$("$venv/bin/python" - <<'PY'
import importlib.metadata as m, re
want = {}
for req in m.requires("vllm-ascend") or []:
    name = re.split(r"[ ;=<>!~\[]", req, maxsplit=1)[0].replace("_", "-").lower()
    pin = re.search(r"==\s*([\w.]+)", req)
    if name in ("memcache-hybrid", "memfabric-hybrid") and pin:
        want[name] = pin.group(1)
print(" ".join(f"{k}=={v}" for k, v in sorted(want.items())))
PY
)
  if [ -n "$pins" ]; then
    say "$(basename "$venv"): installing MemCache as vllm-ascend pins it: $pins"
    pip_q "$venv" --no-deps $pins
  else
    say "$(basename "$venv"): installing MemCache from requirements/memcache.lock (vllm-ascend pins no version)"
    pip_q "$venv" --no-deps -r requirements/memcache.lock
  fi
  "$venv/bin/python" -c "import memcache_hybrid" || { echo "env: memcache_hybrid does not import in $venv" >&2; exit 1; }
}

build_pair() {
  local name=$1 line vllm ascend
  line=$(grep -E "^$name[[:space:]]" scripts/pairs.txt) || { echo "unknown pair $name (see scripts/pairs.txt)" >&2; exit 2; }
  read -r _ vllm ascend _ <<<"$line"
  local venv=$root/$name want="vllm==$vllm vllm-ascend==$ascend +mc$(sha1sum requirements/memcache.lock | cut -c1-8)"
  if [ "$ascend" != "-" ] && sdist_only "$ascend"; then want+=" +$(sha1sum requirements/sdist-pairs.lock | cut -c1-12)"; fi
  if [ -f "$venv/.done" ] && [ "$(cat "$venv/.done")" = "$want" ]; then
    [ -x "$venv/bin/ascend-layerwise-patch" ] || { say "$name: adding this package's console script"; install_self "$venv"; }
    say "$name: ready ($want)"; return
  fi
  say "$name: creating $venv ($want, --no-deps, on top of base)"
  rm -rf "$venv"; "$py" -m venv "$venv"
  local site base_site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  base_site=$("$root/base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # addsitedir (not a bare path) so base's own .pth files -- the editable install -- are processed.
  echo "import site; site.addsitedir('$base_site')" > "$site/_alp_base.pth"
  local pkgs=("vllm==$vllm")
  [ "$ascend" != "-" ] && pkgs+=("vllm-ascend==$ascend")
  if [ "$ascend" != "-" ] && sdist_only "$ascend"; then
    say "$name: downloading and installing vllm==$vllm; vllm-ascend==$ascend from its sdist (no wheel on the index)"
    pip_q "$venv" --no-deps "vllm==$vllm"
    install_ascend_sdist "$venv" "$ascend"
    # base lacks numba (vLLM declares it); 0.30's AscendStore connector reaches vLLM's ngram proposer
    pip_q "$venv" --no-deps -r requirements/sdist-pairs.lock
  else
    say "$name: downloading and installing ${pkgs[*]}"
    pip_q "$venv" --no-deps "${pkgs[@]}"
  fi
  [ "$ascend" != "-" ] && install_memcache "$venv"
  say "$name: installing this package (editable: the console script ascend-layerwise-patch)"
  install_self "$venv"
  echo "$want" > "$venv/.done"
  say "$name: ready"
}

build_ascendc() {
  local venv=$root/ascendc
  local want; want=$(sha1sum requirements/ascendc.lock | cut -c1-12)
  if [ -f "$venv/.done" ] && [ "$(cat "$venv/.done")" = "$want" ]; then say "ascendc: ready ($venv)"; return; fi
  say "ascendc: creating $venv (triton-ascend + ascendnpu-ir from requirements/ascendc.lock, standalone)"
  rm -rf "$venv"; "$py" -m venv "$venv"
  pip_q "$venv" --no-deps -r requirements/ascendc.lock
  "$venv/bin/python" -c "import triton.backends.ascend, ascendnpuir, pytest" \
    || { echo "ascendc venv is broken (triton-ascend has wheels for Python 3.9-3.11 only)" >&2; exit 1; }
  echo "$want" > "$venv/.done"
  say "ascendc: ready"
}

[ $# -eq 0 ] && set -- base
for name in "$@"; do
  case "$name" in
    base) build_base ;;
    ascendc) build_ascendc ;;
    *) build_base; build_pair "$name" ;;
  esac
done
