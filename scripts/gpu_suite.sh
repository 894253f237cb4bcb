#!/usr/bin/env bash
# The GPU suite in the background on the GPU machine, so it can outlast one device call (600 s) and
# run while later calls unpack other folders. Each call there replaces the working tree, so the suite
# runs from a copy in /tmp/gf; logs and the exit status go to /tmp/gpu-suite/.
#
#   export PYTHONPATH=/tmp/site   # the staged wheels
#   bash scripts/gpu_suite.sh start [pytest args]   # default: tests/test_budget_gpu.py first, then all
#   bash scripts/gpu_suite.sh wait [seconds]        # until it ends or the seconds pass; prints a summary
#
# Wait on the status file, never with `pgrep -f` (it matches its own shell's command line).
set -uo pipefail
out=/tmp/gpu-suite
case "${1:-}" in
  start)
    shift
    args=${*:-tests/test_budget_gpu.py tests}
    mkdir -p "$out" && rm -f "$out/rc" && rm -rf /tmp/gf && cp -r "$PWD" /tmp/gf
    cd /tmp/gf || exit 1
    # test_budget_gpu measures pool growth: it runs first, before other tests fill the shared pool.
    setsid nohup bash -c "GRAPHFLEET_COMMIT=\$(cat .graphfleet-commit 2>/dev/null) make test-gpu \
      PYTEST_ARGS='-rfE --durations=10 $args' > $out/log 2>&1; echo \$? > $out/rc" > /dev/null 2>&1 &
    echo "gpu suite started from /tmp/gf: $args (log $out/log)"
    ;;
  wait)
    limit=${2:-540}
    for ((t = 0; t < limit; t += 5)); do [ -f "$out/rc" ] && break; sleep 5; done
    if [ -f "$out/rc" ]; then echo "gpu suite ended: rc $(cat "$out/rc")"; else echo "gpu suite still running"; fi
    grep -E "FAILED|ERROR|passed|failed" "$out/log" | grep -v "runner.py" | tail -40
    ;;
  *)
    echo "usage: $0 start [pytest args] | wait [seconds]" >&2
    exit 2
    ;;
esac
