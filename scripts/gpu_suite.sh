#!/usr/bin/env bash
# The GPU suite in the background on the GPU machine: a one-command queue of scripts/gpu_queue.sh
# (which runs it from a copy of the tree, so it outlasts one device call and later calls may unpack
# other folders meanwhile), with a summary of its outcome.
#
#   export PYTHONPATH=/tmp/site   # the staged wheels
#   bash scripts/gpu_suite.sh start [pytest args]   # default: tests/test_budget_gpu.py first, then all
#   bash scripts/gpu_suite.sh wait [seconds]        # until it ends or the seconds pass; prints a summary
set -uo pipefail
here=$(dirname "$0")
case "${1:-}" in
  start)
    shift
    # test_budget_gpu measures pool growth: it runs first, before other tests fill the shared pool.
    args=${*:-tests/test_budget_gpu.py tests}
    plan=$(mktemp)
    echo "make test-gpu PYTEST_ARGS='-rfE --durations=10 $args'" > "$plan"
    bash "$here/gpu_queue.sh" start "$plan"
    ;;
  wait)
    TAIL_LINES=0 bash "$here/gpu_queue.sh" wait "${2:-540}"
    grep -E "FAILED|ERROR|passed|failed" /tmp/gpu-queue/01.log 2>/dev/null | grep -v "runner.py" | tail -40
    ;;
  *)
    echo "usage: $0 start [pytest args] | wait [seconds]" >&2
    exit 2
    ;;
esac
