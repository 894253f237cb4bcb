#!/usr/bin/env bash
# A queue of GPU runs in the background on the GPU machine: the suite and the benches one after
# another from one start, so the GPU never idles between device calls and no call has to fit a
# whole run into its 600 s. Each call there replaces the working tree, so the queue runs from a
# copy in /tmp/gq; each command's output and exit status go to /tmp/gpu-queue/.
#
#   export PYTHONPATH=/tmp/site   # the staged wheels (the last unpack call)
#   bash scripts/gpu_queue.sh start FILE     # FILE: one shell command a line, run in order ('#': comment)
#   bash scripts/gpu_queue.sh append FILE    # more commands, run from a copy of this call's tree (/tmp/gq-N)
#                                            # after those queued; restarts the runner if it had ended
#   bash scripts/gpu_queue.sh wait [seconds] # until the queue ends or the seconds pass: each command's
#                                            # status and its log's tail; packs the logs and the JSON the
#                                            # benches wrote so far into $OUT/queue.tgz (when $OUT is set)
#
# Commands run in /tmp/gq with PYTHONPATH=/tmp/site:. and GRAPHFLEET_COMMIT from .graphfleet-commit;
# one that fails is reported and the next one runs. `scripts/gpu_plan.txt` is the next session's queue.
# Wait on the status files, never with `pgrep -f` (it matches its own shell's command line).
set -uo pipefail
out=/tmp/gpu-queue
copy=/tmp/gq
case "${1:-}" in
  start)
    plan=${2:?usage: $0 start FILE}
    [ -f "$plan" ] || { echo "no such queue file: $plan" >&2; exit 2; }
    rm -rf "$out" "$copy" && mkdir -p "$out" && cp -a "$PWD" "$copy" || exit 1
    grep -v '^[[:space:]]*\(#\|$\)' "$plan" > "$out/commands"
    n=$(wc -l < "$out/commands")
    cat > "$out/run.sh" <<'EOF'
cd /tmp/gq || exit 1
skip=${1:-0}
unset OUT  # each device call has its own; `wait` copies what the benches wrote into the current one
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}" GRAPHFLEET_COMMIT=$(cat .graphfleet-commit 2>/dev/null)
i=$skip
# one line at a time from the file, so lines appended while a command runs are reached too
while [ "$i" -lt "$(wc -l < /tmp/gpu-queue/commands)" ]; do
  i=$((i + 1)); tag=$(printf '%02d' "$i")
  cmd=$(sed -n "${i}p" /tmp/gpu-queue/commands)
  echo "$cmd" > /tmp/gpu-queue/$tag.cmd
  date +%s > /tmp/gpu-queue/$tag.start
  bash -c "$cmd" > /tmp/gpu-queue/$tag.log 2>&1 < /dev/null
  echo $? > /tmp/gpu-queue/$tag.rc
  date +%s > /tmp/gpu-queue/$tag.end
done
echo done > /tmp/gpu-queue/finished
EOF
    setsid nohup bash "$out/run.sh" > "$out/runner.log" 2>&1 < /dev/null &
    echo "gpu queue started from $copy: $n commands (logs in $out)"
    ;;
  append)
    plan=${2:?usage: $0 append FILE}
    [ -f "$plan" ] && [ -f "$out/run.sh" ] || { echo "no queue to append to, or no such file: $plan" >&2; exit 2; }
    k=1; while [ -e "$copy-$k" ]; do k=$((k + 1)); done
    cp -a "$PWD" "$copy-$k" || exit 1
    grep -v '^[[:space:]]*\(#\|$\)' "$plan" | sed "s|^|cd $copy-$k \\&\\& export GRAPHFLEET_COMMIT=\$(cat .graphfleet-commit 2>/dev/null) \\&\\& |" > "$out/more"
    cat "$out/more" >> "$out/commands"
    sleep 1
    # a runner that had already read to the end has left (or is leaving): a new one runs the rest
    if [ -f "$out/finished" ]; then
      ran=$(ls "$out"/*.rc 2>/dev/null | wc -l)
      rm -f "$out/finished"
      setsid nohup bash "$out/run.sh" "$ran" >> "$out/runner.log" 2>&1 < /dev/null &
    fi
    echo "appended $(wc -l < "$out/more") commands run from $copy-$k"
    ;;
  wait)
    limit=${2:-540}
    for ((t = 0; t < limit; t += 5)); do [ -f "$out/finished" ] && break; sleep 5; done
    total=$(wc -l < "$out/commands" 2>/dev/null || echo 0)
    for cmd in "$out"/*.cmd; do
      [ -f "$cmd" ] || continue
      tag=$(basename "$cmd" .cmd)
      if [ -f "$out/$tag.rc" ]; then
        echo "[$tag] rc $(cat "$out/$tag.rc") in $(( $(cat "$out/$tag.end") - $(cat "$out/$tag.start") )) s: $(cat "$cmd")"
      else
        echo "[$tag] running for $(( $(date +%s) - $(cat "$out/$tag.start") )) s: $(cat "$cmd")"
      fi
      tail -n "${TAIL_LINES:-15}" "$out/$tag.log" | sed 's/^/    /'
    done
    if [ -f "$out/finished" ]; then echo "gpu queue ended ($total commands)"; else echo "gpu queue still running"; fi
    if [ -n "${OUT:-}" ]; then
      # one archive: a device call brings back only so many files
      (cd /tmp && find gpu-queue $(basename "$copy") $(basename "$copy")-* -newer "$out/run.sh" \
          \( -path 'gpu-queue/*' -o -path '*/bench/results/*.json' \) -type f 2>/dev/null \
        | tar czf "$OUT/queue.tgz" -T -)
    fi
    ;;
  *)
    echo "usage: $0 start FILE | append FILE | wait [seconds]" >&2
    exit 2
    ;;
esac
