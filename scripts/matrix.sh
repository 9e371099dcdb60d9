#!/usr/bin/env bash
# The whole test matrix: build the environments, run every suite on every pair, fail if any fails.
#
#   bash scripts/matrix.sh            every pair of scripts/pairs.txt
#   bash scripts/matrix.sh v0251      only the named pairs (the unit suite always runs)
#
# Suites: tests/unit once (base venv); per pair tests/standins and tests/interp, each in its own
# pytest process (the NPU stand-ins break real Triton, so the two never share a process);
# tests/ascend_compile once, in its own venv (triton-ascend: the kernel compiled for Atlas A2/A3).
# Each suite must also run at least its floor of tests (scripts/suite_floor.py, from
# scripts/expected_states.txt): one that skips or deselects everything where tests are due fails.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
pairs=("$@")
[ ${#pairs[@]} -eq 0 ] && mapfile -t pairs < <(grep -vE '^\s*(#|$)' scripts/pairs.txt | awk '{print $1}')
root=${ALP_MATRIX_DIR:-$here/.matrix}
start=$(date +%s)

bash scripts/env.sh "${pairs[@]}" ascendc || { echo "matrix: environment build failed" >&2; exit 1; }
echo "matrix: environments ready in $(( $(date +%s) - start )) s"

failed=(); failed_tests=()
logs=$(mktemp -d); trap 'rm -rf "$logs"' EXIT
. scripts/suite_run.sh  # run NAME SUITE PAIR PYTHON ARGS...

# The standins suites run on every core (pytest-xdist, one test module per worker: a module's
# fixtures and its activation order stay in one process); each test is single-threaded and most of
# their time is child interpreters importing vLLM, so one process keeps one core busy.
# ALP_PYTEST_WORKERS=1 runs them in one process.
workers=${ALP_PYTEST_WORKERS:-$(nproc)}
[ "$workers" -gt 4 ] && workers=4
par=(); [ "$workers" -gt 1 ] && par=(-n "$workers" --dist loadfile)
echo "matrix: standins suites on $workers pytest worker(s)"

run "unit" unit - "$root/base/bin/python" tests/unit
run "ascend compile" ascend_compile - "$root/ascendc/bin/python" tests/ascend_compile
# The pool tests run on the real MemCache (each pair's own version) on the pairs of record; v0250 and
# v0290 differ from v0251 / v0300 in vLLM only, and run theirs on the byte store (ALP_POOL_STORE)
store_of() { case $1 in v0250|v0290) echo bytes ;; esac; }
for pair in "${pairs[@]}"; do
  ALP_POOL_STORE=$(store_of "$pair") run "$pair standins" standins "$pair" "$root/$pair/bin/python" "${par[@]}" tests/standins
  run "$pair interp" interp "$pair" "$root/$pair/bin/python" tests/interp
done

# The benchmarks must keep running: tiny versions on the primary pair (numbers are not judged here).
smoke() {
  local name=$1; shift
  echo "=== smoke: $name (does it run? interpreter / CPU timings and ratios are not judged)"
  "$@" || failed+=("smoke: $name (exit $?)")
}
if [ -x "$root/v0251/bin/python" ]; then
  smoke bench_hotpath "$root/v0251/bin/python" scripts/bench_hotpath.py --quick
  smoke bench_precopy "$root/v0251/bin/python" scripts/bench_precopy.py --quick
  smoke bench_shedding "$root/v0251/bin/python" scripts/bench_shedding.py --quick
  smoke bench_async_fences "$root/v0251/bin/python" scripts/bench_async_fences.py --quick
  smoke bench_pool_metrics "$root/v0251/bin/python" scripts/bench_pool_metrics.py --quick
  smoke bench_load_agreement "$root/v0251/bin/python" scripts/bench_load_agreement.py --quick
  # vLLM's and vllm-ascend's kernel files come out of their wheels into git-ignored .bench/ (the wheels
  # go to a temporary folder and are deleted)
  smoke "fetch reference kernels" "$root/v0251/bin/python" scripts/bench_postprocess.py fetch
  smoke bench_postprocess env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= VLLM_PLUGINS= "$root/v0251/bin/python" scripts/bench_postprocess.py --cpu-smoke
fi
if [ -x "$root/v0300/bin/python" ]; then  # pool_metrics' 0.30 members: upstream's own stats path, extended
  smoke "bench_pool_metrics (0.30)" "$root/v0300/bin/python" scripts/bench_pool_metrics.py --quick
fi

echo "matrix: ${#pairs[@]} pairs in $(( $(date +%s) - start )) s"
# the figures docs/measured.md quotes, measured on every run
bench=$(du -sh .bench 2>/dev/null | cut -f1)
for env in "$root"/*/; do  # one line per environment (scripts/figures.py reads them)
  echo "matrix: disk: $(basename "$env") $(du -sh "$env" 2>/dev/null | cut -f1)"
done
echo "matrix: on disk: $(du -sh "$root" 2>/dev/null | cut -f1) in $root (all venvs), ${bench:-0} in .bench; $(nproc) cores, $(date -u +%F)"
if [ ${#failed[@]} -ne 0 ]; then
  [ ${#failed_tests[@]} -ne 0 ] && printf 'matrix: failing test: %s\n' "${failed_tests[@]}"
  printf 'matrix: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "matrix: all suites passed"
