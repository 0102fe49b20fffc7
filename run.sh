#!/usr/bin/env bash
# cosyvoice-grpo recipe. Stages (logic lives in Python: `python -m grpo <stage> ...`):
#   -1 models    grpo/model/prepare.py        build tiny models / download CosyVoice2 + SenseVoice, convert the LLM to HF
#    0 data      grpo/data/stage.py           JSONL -> verl parquet
#    1 serve     reward_server/serve.py       reward server (Ray Serve); foreground alone, background inside a range
#    2 train     grpo/train/launch.py         GRPO (local engine or verl)
#    3 merge     grpo/train/merge.py          checkpoints -> Hugging Face
#    4 evaluate  grpo/evaluate/stage.py       zero-shot CER report
#    5 export    grpo/model/export.py         Hugging Face -> CosyVoice llm.pt
#
# Usage:
#   bash run.sh                          the whole pipeline on the tiny profile (sets up .venv if missing)
#   bash run.sh setup                    create/update .venv
#   bash run.sh test [pytest args]       the test suite on 2 xdist workers (slow tests opt-in: -m slow, in one process)
#   bash run.sh test fast [pytest args]  the unit tier: no server, vLLM engine, verl or model past the tiny one (~2 min)
#   bash run.sh START STOP [key=value]   stages START..STOP with Hydra overrides, e.g.
#                                        bash run.sh 0 0 data.train_file=my.jsonl
#                                        bash run.sh -1 5 profile=cosyvoice2
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
STAGE_NAMES=(models data serve train merge evaluate export)   # index = stage + 1

log() { echo "$(date '+%Y-%m-%d %H:%M:%S') [run.sh] $*"; }

ensure_venv() {
  if [ ! -f "$VENV/.setup-stamp" ]; then
    log "no $VENV yet: running setup first"
    bash scripts/setup_env.sh
  fi
}

case "${1:-}" in
  setup) exec bash scripts/setup_env.sh ;;
  test)
    shift
    ensure_venv
    # slow tests are opt-in: the default marker is "not slow"; a -m of the caller's replaces it
    # (bash run.sh test -m slow; -m "" for everything)
    marker=(-m "not slow")
    if [ "${1:-}" = fast ]; then
      shift
      marker=(-m "not slow and not server and not vllm and not verl and not realsize and not fullsize")
    fi
    # the default and fast tiers run on GRPO_TEST_WORKERS pytest-xdist workers (2: this machine's cores; each
    # worker's torch gets its share of them, tests/conftest.py), a test file per worker at a time (--dist loadfile:
    # a file's fixtures and servers stay in one process). A -m of the caller's (the slow and real-size tiers, each
    # near the memory limit alone), a -n or -p no:xdist runs as asked
    workers=(-n "${GRPO_TEST_WORKERS:-2}" --dist loadfile)
    for arg in "$@"; do
      case "$arg" in
        -m|-m*|--markexpr|--markexpr=*) marker=(); workers=() ;;
        -n|-n*|--numprocesses|--numprocesses=*|no:xdist|-pno:xdist) workers=() ;;
      esac
    done
    exec "$PY" -m pytest ${marker[@]+"${marker[@]}"} ${workers[@]+"${workers[@]}"} "$@" ;;
  -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac

start=${1:--1}
stop=${2:-5}
[ $# -ge 2 ] && shift 2 || shift $#
overrides=("$@")
for s in "$start" "$stop"; do
  if ! [[ "$s" =~ ^-?[0-9]+$ ]] || [ "$s" -lt -1 ] || [ "$s" -gt 5 ]; then
    echo "stage must be an integer in -1..5, got '$s' (see bash run.sh --help)" >&2
    exit 2
  fi
done
ensure_venv

server_pid=""
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    log "stopping the reward server (pid $server_pid)"
    kill -INT "$server_pid" 2>/dev/null || true
    # Serve and Ray shut down within seconds; a server still starting up may not handle SIGINT yet
    for _ in $(seq 600); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$server_pid" 2>/dev/null; then
      log "the reward server did not stop within 60 s of SIGINT: killing it"
      kill -KILL "$server_pid" 2>/dev/null || true
    fi
    wait "$server_pid" 2>/dev/null || true
  fi
}
trap stop_server EXIT

run_stage() {
  local stage=$1 name=${STAGE_NAMES[$(($1 + 1))]}
  log "stage $stage ($name): start"
  local t0=$SECONDS rc=0
  "$PY" -m grpo "$name" "${overrides[@]}" || rc=$?
  if [ $rc -ne 0 ]; then
    log "stage $stage ($name): FAILED with exit code $rc"
    exit $rc
  fi
  log "stage $stage ($name): done in $((SECONDS - t0)) s"
}

t_start=$SECONDS
for ((stage = start; stage <= stop; stage++)); do
  if [ "$stage" -eq 1 ] && [ "$stop" -gt 1 ]; then
    # the server is needed by later stages: run it in the background until this script exits
    log "stage 1 (serve): starting the reward server in the background (log: server.log in exp dir)"
    logfile=$("$PY" -m reward_server.launch logfile "${overrides[@]}")
    "$PY" -m grpo serve "${overrides[@]}" >"$logfile" 2>&1 &
    server_pid=$!
    "$PY" -m reward_server.launch wait --pid "$server_pid" "${overrides[@]}" || { log "stage 1 (serve): FAILED (see $logfile)"; exit 1; }
    log "stage 1 (serve): ready"
    continue
  fi
  run_stage "$stage"
done
stop_server
server_pid=""
log "stages $start..$stop done in $((SECONDS - t_start)) s"
if [ "$stop" -ge 4 ] && [ "$start" -le 4 ]; then
  "$PY" -m grpo.evaluate.report summary "${overrides[@]}"
fi
