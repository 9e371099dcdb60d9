# Sourced by scripts/matrix.sh (and tests/unit/test_suite_floor.py); needs $logs (a folder) and
# the arrays failed=() and failed_tests=(). One suite: a pytest run that must pass and run at least its floor of tests.
# shellcheck shell=bash
run() {  # run NAME SUITE PAIR PYTHON ARGS...: a pytest run that must pass and run at least its floor of tests
  local name=$1 suite=$2 pair=$3 python=$4; shift 4
  local t0 log=$logs/run.log; t0=$(date +%s)
  echo "=== $name"
  "$python" -m pytest -p no:cacheprovider -q "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || failed+=("$name (exit $rc)")
  # each failing test by node id, with pytest's one-line reason (its short summary)
  local line
  while IFS= read -r line; do failed_tests+=("$name: ${line:0:220}"); done < <(grep -E '^(FAILED|ERROR) [^ ]+\.py' "$log")
  # scripts/suite_floor.py: the least tests this suite must run on this pair (from scripts/expected_states.txt)
  local floor; floor=$("${PYTHON:-python3}" scripts/suite_floor.py "$suite" "$pair" "$log")
  local frc=$?
  echo "=== $name: $floor"
  [ $frc -eq 0 ] || failed+=("$name (ran fewer tests than its floor)")
}
