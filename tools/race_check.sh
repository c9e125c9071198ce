#!/usr/bin/env bash
# The tests that wait on another process (signals, locks, a server going away, SLURM
# preemption), run N times in a row beside a CPU hog of H busy processes (default 10 rounds,
# 2 hogs: every core of a 2-core machine taken).  Stops at the first failing round.
#   tools/race_check.sh [ROUNDS] [HOGS]        (SMALLBATCH_REQUIRE_SLURM=1 for the SLURM test)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-10}
HOGS=${2:-2}
TESTS=(
  "tests/test_faults.py::test_sigkill_of_the_whole_workflow_mid_epoch_then_rerun_resumes"
  "tests/test_faults.py::test_sigterm_preempted_job_exits_143_and_snakemake_retry_finishes_it"
  "tests/test_faults.py::test_mlflow_server_goes_away_mid_study_then_rerun_completes_without_duplicates"
  "tests/pipeline/test_warm.py"
  "tests/pipeline/test_warm_status.py"
  "tests/pipeline/test_store_deadlines.py"
  "tests/pipeline/test_reliability.py::test_a_second_trainer_of_a_cell_stops_at_once_naming_the_holder"
  "tests/pipeline/test_reliability.py::test_a_store_deleted_while_the_cell_trains_stops_it_before_the_next_save"
  "tests/training/test_train.py::test_resume_after_sigkill_is_bitwise_identical"
  "tests/training/test_train.py::test_sigterm_saves_state_at_current_step_and_exits_143"
  "tests/report/test_report_package.py::test_stopped_server_fails_fast_with_one_line"
  "tests/test_slurm.py::test_preempted_slurm_job_resumes_on_retry"
  "tests/training/test_rank_signals.py"
)
hogs=()
for _ in $(seq "$HOGS"); do (while :; do :; done) & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
for round in $(seq "$ROUNDS"); do
  start=$(date +%s)
  if ! .venv/bin/python -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" > "/tmp/race_check.round$round.log" 2>&1; then
    echo "round $round FAILED (load $(cut -d' ' -f1-3 /proc/loadavg)); log: /tmp/race_check.round$round.log"
    tail -30 "/tmp/race_check.round$round.log"
    exit 1
  fi
  echo "round $round passed in $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(grep -E "^[0-9]+ passed" /tmp/race_check.round$round.log | tail -1)"
done
echo "$ROUNDS of $ROUNDS rounds passed beside $HOGS busy processes"
