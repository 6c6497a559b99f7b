#!/usr/bin/env bash
# The demo's steps (`make demo` runs this; tests/integration/test_demo_smoke.py runs it on ML-100k):
# replay -> join -> train -> refresh -> serve and score, with `streamrec monitor` in the background scraping
# the joiner, the learner and serving into a run log, and `streamrec report` writing an HTML report of it.
#
# Everything of one run is named after it: topics demo-<id>-*, Redis keys demo-<id>:*, consumer groups, and
# the directory .streamrec/demo/<id> (checkpoints, deltas, publish root, summaries, run log, report), so
# running it again on a live stack starts afresh. Settings, all optional:
#   DEMO_DATASET (ml-1m)  DEMO_LIMIT (all impressions)  DEMO_USER (1m_1 for ml-1m, 1 otherwise)
#   DEMO_DIR (.streamrec/demo/<id>)  DEMO_STACK (1: `streamrec stack up`; 0: use the stack the STREAMREC_*
#   settings name)  DEMO_JOIN_PORT (19201)  DEMO_LEARNER_PORT (19202)  DEMO_SERVE_PORT (18080)
#   DEMO_INTERVAL (1: seconds between the monitor's scrapes)  SR (.venv/bin/streamrec)  PY (.venv/bin/python)
#   DEMO_IDLE (5: seconds without input after which the join and the training end)
set -euo pipefail

SR=${SR:-.venv/bin/streamrec}
PY=${PY:-.venv/bin/python}
dataset=${DEMO_DATASET:-ml-1m}
id=$(date +%Y%m%d-%H%M%S)-$$
run=${DEMO_DIR:-.streamrec/demo/$id}
join_port=${DEMO_JOIN_PORT:-19201}
learner_port=${DEMO_LEARNER_PORT:-19202}
serve_port=${DEMO_SERVE_PORT:-18080}
idle=${DEMO_IDLE:-5}
interval=${DEMO_INTERVAL:-1}
# the monitor runs in the background: a value it refuses ended it at once, unnoticed until the end of the run
[[ $interval =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] && awk "BEGIN { exit !($interval > 0 && $interval < 1e9) }" ||
  { echo "demo: DEMO_INTERVAL must be a number of seconds > 0, got '$interval'" >&2; exit 2; }
if [[ $dataset == ml-1m ]]; then user=${DEMO_USER:-1m_1}; else user=${DEMO_USER:-1}; fi
limit=()
[[ -n ${DEMO_LIMIT:-} ]] && limit=(--limit "$DEMO_LIMIT")

export STREAMREC_KAFKA_IMPRESSIONS_TOPIC=demo-$id-impressions STREAMREC_KAFKA_CLICKS_TOPIC=demo-$id-clicks \
  STREAMREC_KAFKA_SAMPLES_TOPIC=demo-$id-samples STREAMREC_REDIS_PREFIX=demo-$id \
  STREAMREC_LEARNER_GROUP_ID=demo-$id-learner \
  STREAMREC_LEARNER_DELTAS_EVERY_S=2 STREAMREC_LEARNER_DELTAS_DIR=$run/deltas
mkdir -p "$run"
step() { printf '\n== %s\n' "$*" >&2; }

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
# a stage in the background, with a progress line per scrape of it from the run log until it ends
follow() {
  local source=$1 out=$2; shift 2
  "$@" --json >"$out" &
  local pid=$!
  pids+=("$pid")
  "$SR" report --run-log "$run/run-log.jsonl" --follow "$source" --pid "$pid"
  local rc=0
  wait "$pid" || rc=$?
  halt_on_signal "$source" "$rc" "$out"
}
# A stage a signal ended (killed by it: 128+n) or stopped (it took a SIGINT/SIGTERM, saved what it had and exited 0,
# "reason": "signal" in its summary): the demo goes no further, or it refreshed and served a partly trained model.
# The demo itself never sees that SIGINT: started in the background by a non-interactive shell, it ignores it, and a
# signal ignored at a shell's start cannot be trapped.
halt_on_signal() {
  local stage=$1 rc=$2 out=$3
  if ((rc > 128)); then
    echo "demo: the $stage was ended by signal $((rc - 128)) (SIG$(kill -l "$rc")): stopping here" >&2; exit "$rc"
  elif ((rc != 0)); then
    echo "demo: the $stage failed (exit $rc): stopping here" >&2; exit "$rc"
  fi
  digest "$stage" "$out"
}
# A stage's summary read once, as the report reads it (monitor.recording.read_summaries), one line of it shown. None to
# read (missing, empty, not JSON: the stage killed while writing it, a full disk) stops the demo naming the stage and
# the file, as a failed stage does; "reason": "signal" stops it too. The signal check had a json.load of its own: it
# took an unreadable summary for a stage that ended well, and missed the reason after any other line.
digest() {
  local stage=$1 out=$2 reason
  reason=$("$PY" -c 'import sys; from monitor.recording import ReportError, read_summaries; from monitor.report import summary_line
try: summaries = read_summaries(sys.argv[1:])
except (OSError, ReportError) as e: sys.exit(f"{type(e).__name__}: {e}")
for stage, d in summaries.items(): print(f"  {stage}: {summary_line(stage, d)}", file=sys.stderr); print(d.get("reason"))
' "$out") || { echo "demo: the $stage left no summary to read in $out: stopping here" >&2; exit 1; }
  if [[ $reason == signal ]]; then
    echo "demo: the $stage was stopped by a signal (SIGINT/SIGTERM) before its input ended: stopping here," \
      "nothing partly done is refreshed or served ($out)" >&2
    exit 1
  fi
}

if [[ ${DEMO_STACK:-1} == 1 ]]; then step "local stack"; "$SR" stack up; fi

step "monitor: scraping joiner :$join_port, learner :$learner_port, serving :$serve_port every ${interval}s into $run/run-log.jsonl"
{ "$PY" -c 'from monitor.rules import default_rules_text; print(default_rules_text())'
  printf '\n[run_log]\npath = "%s"\n' "$run/run-log.jsonl"; } >"$run/monitor-rules.toml"
"$SR" monitor --rules "$run/monitor-rules.toml" --interval "$interval" --log-level error \
  --source "joiner=http://127.0.0.1:$join_port/metrics" --source "learner=http://127.0.0.1:$learner_port/metrics" \
  --source "serving=http://127.0.0.1:$serve_port/metrics" --json >"$run/monitor.out" 2>"$run/monitor.log" &
monitor_pid=$!
pids+=("$monitor_pid")

step "replay $dataset into demo-$id-impressions / -clicks"
"$SR" replay --dataset "$dataset" "${limit[@]}" --json >"$run/replay.json"
digest replay "$run/replay.json"

step "join (group demo-$id-join)"
follow joiner "$run/join.json" "$SR" join --driver kafka --app-id "demo-$id-join" --exit-when-idle "$idle" --drain \
  --metrics-port "$join_port"
"$SR" counts top --kind item --event click --days 30 --k 5

step "train (checkpoints and deltas in $run)"
follow learner "$run/train.json" "$SR" train --checkpoint-dir "$run/checkpoints" --exit-when-idle "$idle" \
  --metrics-port "$learner_port"

step "refresh: hot set from Redis, artifact, validation, publish"
"$SR" refresh --now --checkpoint-dir "$run/checkpoints" --publish-root "$run/serving" --json >"$run/refresh.json"
digest refresh "$run/refresh.json"

step "serve on :$serve_port, and score real users"
"$SR" serve --port "$serve_port" --publish-root "$run/serving" --deltas-dir "$run/deltas" --log-level warning &
serve_pid=$!
pids+=("$serve_pid")
"$PY" -m serving.demo --url "http://127.0.0.1:$serve_port" --dataset "$dataset" --user "$user" --k 5
for u in 2 3 4 5 6; do  # a little more traffic, so serving's metrics have a few scrapes to show
  [[ $dataset == ml-1m ]] && u=1m_$u
  "$PY" -m serving.demo --url "http://127.0.0.1:$serve_port" --dataset "$dataset" --user "$u" --k 20 --json >/dev/null
done
sleep "$(awk "BEGIN {print 2 * $interval + 0.5}")"  # the monitor's last scrapes of serving
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true
if kill -TERM "$monitor_pid" 2>/dev/null; then wait "$monitor_pid" || true
else  # ended early (killed, crashed): a bare `kill` failed here under set -e, and the run ended with no report
  rc=0; wait "$monitor_pid" || rc=$?
  echo "demo: the monitor ended before the run did (exit $rc, its log $run/monitor.log): the report has what it recorded" >&2
fi
if [[ -s $run/monitor.out ]]; then mv "$run/monitor.out" "$run/monitor.json"; else rm -f "$run/monitor.out"; fi
pids=()

step "report"
"$SR" report --run-dir "$run"
printf '\nOpen %s/report.html in a browser. Stop the local stack with: make stack-down (or %s stack down);\n' \
  "$run" "$SR"
printf 'this run'"'"'s files: %s (remove them with rm -rf %s).\n' "$run" "$run"
