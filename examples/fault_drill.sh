#!/usr/bin/env bash
# A first fault drill: kill -9 one worker of a running digits job from outside, on both
# recovery paths, and show what the runner logged. Run it from the checkout's root:
#
#     bash examples/fault_drill.sh [DIR]     # DIR: where the two runs go (default runs/drill)
#
# The warm spare starts as soon as the workers built the task here (the default,
# recovery.spare_delay_seconds, is 10 s: a short job never pays for one).
#
# In place (the default under `elastic-runner run`): the agent hands the dead worker's rank to
# its warm spare and the other worker keeps its process. Restart (`recovery.mode=restart`, what
# plain torchrun does): every worker is stopped and started again, and they resume from the
# newest checkpoint.
set -euo pipefail
dir=${1:-runs/drill}
mkdir -p "$dir"

descendants() {  # every process below pid $1 (by parent pid, not by name: only this job's)
  local child
  for child in $(pgrep -P "$1"); do
    echo "$child"
    descendants "$child"
  done
}

oldest_worker() {  # the oldest of job $1's own processes that runs `elastic_runner train`
  local pids
  pids=$(descendants "$1" | paste -sd, -)
  [ -n "$pids" ] || return 1
  ps -o etimes=,pid=,args= -p "$pids" | grep -F "elastic_runner train" | sort -k1,1nr \
    | awk 'NR == 1 {print $2}'
}

drill() {  # $1: name; $2: the log line to wait for before the kill; then run's extra arguments
  local name=$1 ready=$2 log="$dir/$1.log"
  shift 2
  elastic-runner run configs/digits.yaml training.max_epochs=20 early_stopping.enabled=false \
    recovery.spare_delay_seconds=0 logging.tensorboard_dir=null checkpoint.dir="$dir/$name" \
    "$@" >"$log" 2>&1 &
  local job=$!
  until grep -q "$ready" "$log"; do
    kill -0 "$job" 2>/dev/null || { echo "the $name run ended before the kill"; exit 1; }
    sleep 0.2
  done
  # the oldest worker of this job (the spare starts after the workers); no other job's
  local worker
  worker=$(oldest_worker "$job") || { echo "the $name run has no worker to kill"; exit 1; }
  kill -9 "$worker"
  wait "$job"
  echo "--- $name: what the runner logged"
  grep -E "exited with code|in-place recovery [0-9]+ done|resumed from|finished:" "$log"
}

drill in-place "spare .* ready"
drill restart "epoch 5 " recovery.mode=restart
