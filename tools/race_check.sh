#!/usr/bin/env bash
# The tests that wait on another process (signals, locks, a server going away, SLURM
# preemption), run N times in a row beside a CPU hog of H busy processes (default 10 rounds,
# 2 hogs: every core of a 2-core machine taken).  Stops at the first failing round.
#   tools/race_check.sh [ROUNDS] [HOGS]          (SMALLBATCH_REQUIRE_SLURM=1 for the SLURM test)
# With --suite, each round is the whole suite instead (`make test`'s pytest in TEST_WORKERS
# workers, default 2; default 1 round beside 6 hogs), and its wall time, CPU seconds and load
# (sampled every 10 s) are printed;
# arguments after -- go to pytest:
#   tools/race_check.sh --suite [ROUNDS] [HOGS] [-- PYTEST_ARGS...]   (e.g. -- -m "not slurm")
# PYTHON names the interpreter of the venv to test with (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE=0
if [ "${1:-}" = "--suite" ]; then SUITE=1; shift; fi
POS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do POS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
ROUNDS=${POS[0]:-$([ "$SUITE" = 1 ] && echo 1 || echo 10)}
HOGS=${POS[1]:-$([ "$SUITE" = 1 ] && echo 6 || echo 2)}
PY=${PYTHON:-.venv/bin/python}
TESTS=(
  "tests/test_faults.py::test_sigkill_of_the_whole_workflow_mid_epoch_then_rerun_resumes"
  "tests/test_faults.py::test_sigterm_preempted_job_exits_143_and_snakemake_retry_finishes_it"
  "tests/test_faults.py::test_mlflow_server_goes_away_mid_study_then_rerun_completes_without_duplicates"
  "tests/local/test_warm.py"
  "tests/local/test_warm_status.py"
  "tests/tracking/test_store_deadlines.py"
  "tests/pipeline/test_reliability.py::test_a_second_trainer_of_a_cell_stops_at_once_naming_the_holder"
  "tests/pipeline/test_reliability.py::test_a_store_deleted_while_the_cell_trains_stops_it_before_the_next_save"
  "tests/training/test_train.py::test_resume_after_sigkill_is_bitwise_identical"
  "tests/training/test_train.py::test_sigterm_saves_state_at_current_step_and_exits_143"
  "tests/report/test_report_package.py::test_stopped_server_fails_fast_with_one_line"
  "tests/test_slurm.py::test_preempted_slurm_job_resumes_on_retry"
  "tests/training/test_rank_signals.py"
)
ARGS=(-x "${TESTS[@]}")
if [ "$SUITE" = 1 ]; then ARGS=(-ra -n "${TEST_WORKERS:-2}" --durations=40 "$@"); fi
hogs=()
for _ in $(seq "$HOGS"); do (while :; do :; done) & hogs+=($!); done
sampler=""
trap 'kill "${hogs[@]}" $sampler 2>/dev/null || true' EXIT
for round in $(seq "$ROUNDS"); do
  log="/tmp/race_check.round$round.log"
  loads="/tmp/race_check.round$round.load"
  (while :; do cut -d' ' -f1 /proc/loadavg; sleep 10; done) > "$loads" &
  sampler=$!
  start=$(date +%s)
  rc=0
  /usr/bin/time -f "%e s wall, %U s user, %S s system" -o "$log.time" \
    "$PY" -m pytest -q -p no:cacheprovider "${ARGS[@]}" > "$log" 2>&1 || rc=$?
  kill "$sampler" 2>/dev/null || true
  sampler=""
  summary="$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$" "$log" | tail -1)"
  range="load $(sort -n "$loads" | head -1)-$(sort -n "$loads" | tail -1) (1-min average, every 10 s)"
  if [ "$rc" != 0 ]; then
    echo "round $round FAILED ($range); log: $log"
    tail -30 "$log"
    exit 1
  fi
  echo "round $round passed in $(( $(date +%s) - start )) s ($(cat "$log.time")), $range: $summary"
done
echo "$ROUNDS of $ROUNDS rounds passed beside $HOGS busy processes"
