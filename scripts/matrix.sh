#!/usr/bin/env bash
# The whole test matrix: build the environments, run every suite on every pair, fail if any fails.
#
#   bash scripts/matrix.sh            every pair of scripts/pairs.txt
#   bash scripts/matrix.sh v0251      only the named pairs (the unit suite always runs)
#
# Suites: tests/unit once (base venv); per pair tests/standins and tests/interp, each in its own
# pytest process (the NPU stand-ins break real Triton, so the two never share a process).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
pairs=("$@")
[ ${#pairs[@]} -eq 0 ] && mapfile -t pairs < <(grep -vE '^\s*(#|$)' scripts/pairs.txt | awk '{print $1}')
root=${ALP_MATRIX_DIR:-$here/.matrix}
start=$(date +%s)

bash scripts/env.sh "${pairs[@]}" || { echo "matrix: environment build failed" >&2; exit 1; }
echo "matrix: environments ready in $(( $(date +%s) - start )) s"

failed=()
run() {  # run NAME PYTHON ARGS...: a pytest run that must pass and must run at least one test
  local name=$1 python=$2; shift 2
  local t0; t0=$(date +%s)
  echo "=== $name"
  "$python" -m pytest -p no:cacheprovider -q "$@"
  local rc=$?
  echo "=== $name: exit $rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || failed+=("$name (exit $rc)")
}

run "unit" "$root/base/bin/python" tests/unit
for pair in "${pairs[@]}"; do
  run "$pair standins" "$root/$pair/bin/python" tests/standins
  run "$pair interp" "$root/$pair/bin/python" tests/interp
done

echo "matrix: ${#pairs[@]} pairs in $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -ne 0 ]; then
  printf 'matrix: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "matrix: all suites passed"
