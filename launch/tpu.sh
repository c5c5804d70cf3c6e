#!/usr/bin/env bash
# Cloud TPU pods through queued resources: create, sync, setup, run, logs, babysit, delete.
# Every worker of the pod runs the same command; main calls jax.distributed.initialize(), which
# finds the TPU cluster by itself. Run `launch/tpu.sh -h` for the usage text.
set -euo pipefail

# The synced checkout on every worker is ~/resconv_jax: the remote side of each command names it
# literally, so that the worker's shell expands the tilde.

usage() {
  cat <<'EOF'
usage: launch/tpu.sh [options] COMMAND [options] [-- MAIN_FLAGS...]

Cloud TPU pod through a queued resource (QR). Each worker gets the same checkout in
~/resconv_jax, the same venv, and the same command:
  python -m resconv_jax.main MAIN_FLAGS   (log: ~/resconv_jax/logs/run.log on each worker)

commands:
  create             create the queued resource and wait until it is ACTIVE
  sync               git archive HEAD, copy it to every worker, unpack into ~/resconv_jax
                     (committed files only: commit first)
  setup              on every worker: venv (~/resconv_jax/.venv), jax[tpu], requirements, -e .
  run -- FLAGS       on every worker: free the TPU, start main FLAGS in the background
  logs               print the tail of each worker's log (--worker=all) or of one (--worker=I)
  status             print the QR state and each worker's run state
  babysit -- FLAGS   watch until the run is finished; on a preemption (QR SUSPENDED, PREEMPTED,
                     FAILED, or gone) delete, create, sync, setup and run FLAGS again: with a
                     gs:// --workdir the run resumes from its last checkpoint
  delete             delete the queued resource and its TPU VM

options (or environment variables):
  --name NAME            QR and TPU VM name                         (TPU_NAME; required)
  --zone ZONE            e.g. us-west4-a                            (TPU_ZONE; required)
  --project PROJECT      default: gcloud's configured project       (TPU_PROJECT)
  --accelerator TYPE     default v5litepod-16                       (TPU_ACCELERATOR)
  --runtime VERSION      default v2-alpha-tpuv5-lite                (TPU_RUNTIME)
  --spot | --reserved    provisioning model; default on-demand      (TPU_PROVISIONING=spot|reserved)
  --worker all|I         logs: which worker(s), default all         (TPU_WORKER)
  --lines N              logs: lines per worker, default 50         (TPU_LOG_LINES)
  --dry-run              print each command (copy-pasteable, one a line) instead of running it
                                                                    (TPU_DRY_RUN=1)
  -h, --help             this text

tuning (environment only):
  TPU_POLL_SECONDS=30         between two state checks (create, delete, babysit)
  TPU_TIMEOUT_SECONDS=86400   longest wait for ACTIVE (or for a deleted QR to be gone)
  TPU_SSH_RETRIES=3           tries of each scp/ssh (a fresh VM may refuse ssh for a while)
  TPU_MAX_RESTARTS=100        babysit gives up after this many recoveries
  TPU_PYTHON=python3.11       interpreter for the venv on the workers (installed by apt if absent)

A run is finished when main exited 0 on every worker without a preemption line ("rerun the
same command" in its log): the run wrapper writes logs/DONE then, and logs/exit_status always.

example (configs/jena.py on a v5e-16 spot pod, resumable from gs://):
  export TPU_NAME=resconv-jena TPU_ZONE=us-west4-a
  launch/tpu.sh create --spot && launch/tpu.sh sync && launch/tpu.sh setup
  launch/tpu.sh run -- --config=configs/jena.py --workdir=gs://BUCKET/resconv/jena
  launch/tpu.sh babysit --spot -- --config=configs/jena.py --workdir=gs://BUCKET/resconv/jena
  launch/tpu.sh delete
EOF
}

die() {
  printf 'tpu.sh: error: %s\n' "$*" >&2
  exit 1
}

note() { printf 'tpu.sh: %s\n' "$*" >&2; }

# --- options --------------------------------------------------------------------------------

NAME=${TPU_NAME:-}
ZONE=${TPU_ZONE:-}
PROJECT=${TPU_PROJECT:-}
ACCELERATOR=${TPU_ACCELERATOR:-v5litepod-16}
RUNTIME=${TPU_RUNTIME:-v2-alpha-tpuv5-lite}
PROVISIONING=${TPU_PROVISIONING:-}
WORKER=${TPU_WORKER:-all}
LOG_LINES=${TPU_LOG_LINES:-50}
DRY_RUN=${TPU_DRY_RUN:-0}
POLL_SECONDS=${TPU_POLL_SECONDS:-30}
TIMEOUT_SECONDS=${TPU_TIMEOUT_SECONDS:-86400}
SSH_RETRIES=${TPU_SSH_RETRIES:-3}
MAX_RESTARTS=${TPU_MAX_RESTARTS:-100}
PYTHON=${TPU_PYTHON:-python3.11}
COMMAND=''
MAIN_FLAGS=()

set_provisioning() {
  if [[ -n $PROVISIONING && $PROVISIONING != "$1" && ${PROVISIONING_FROM_FLAG:-0} == 1 ]]; then
    die "--spot and --reserved exclude each other"
  fi
  PROVISIONING=$1
  PROVISIONING_FROM_FLAG=1
}

parse_args() {
  local arg value
  while (($#)); do
    arg=$1
    shift
    case $arg in
      --) MAIN_FLAGS=("$@"); return ;;
      -h | --help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --spot) set_provisioning spot ;;
      --reserved) set_provisioning reserved ;;
      --name | --zone | --project | --accelerator | --runtime | --worker | --lines)
        (($#)) || die "$arg needs a value"
        value=$1
        shift
        set_option "$arg" "$value"
        ;;
      --name=* | --zone=* | --project=* | --accelerator=* | --runtime=* | --worker=* | --lines=*)
        set_option "${arg%%=*}" "${arg#*=}"
        ;;
      -*) die "unknown option $arg (see -h)" ;;
      *)
        [[ -z $COMMAND ]] || die "one command at a time (got $COMMAND and $arg; main's flags go after --)"
        COMMAND=$arg
        ;;
    esac
  done
}

set_option() {
  case $1 in
    --name) NAME=$2 ;;
    --zone) ZONE=$2 ;;
    --project) PROJECT=$2 ;;
    --accelerator) ACCELERATOR=$2 ;;
    --runtime) RUNTIME=$2 ;;
    --worker) WORKER=$2 ;;
    --lines) LOG_LINES=$2 ;;
  esac
}

check_options() {
  [[ -n $NAME ]] || die "no TPU name: pass --name NAME or set TPU_NAME"
  [[ -n $ZONE ]] || die "no zone: pass --zone ZONE or set TPU_ZONE"
  case $PROVISIONING in
    '' | spot | reserved) ;;
    *) die "TPU_PROVISIONING=$PROVISIONING: use spot, reserved or nothing" ;;
  esac
  [[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || die "--worker $WORKER: use all or a number"
  [[ $LOG_LINES =~ ^[0-9]+$ ]] || die "--lines $LOG_LINES: not a number"
  local n
  for n in POLL_SECONDS TIMEOUT_SECONDS SSH_RETRIES MAX_RESTARTS; do
    [[ ${!n} =~ ^[0-9]+$ ]] || die "TPU_$n=${!n}: not a whole number"
  done
}

dry() { [[ $DRY_RUN == 1 ]]; }

# --- printing and running commands ------------------------------------------------------------

# One word for a POSIX shell: as is when it is safe, else single-quoted (--flag='value').
shq() {
  if [[ $1 =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ ^(--[A-Za-z0-9-]+=)(.*)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    shq "${BASH_REMATCH[2]}"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Escapes a text for use inside double quotes.
dq_escape() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//\$/\\\$}
  s=${s//\`/\\\`}
  printf '%s' "$s"
}

shell_line() {
  local out='' word
  for word in "$@"; do
    out+="${out:+ }$(shq "$word")"
  done
  printf '%s\n' "$out"
}

# Runs a command, or prints it under --dry-run.
do_cmd() {
  if dry; then
    shell_line "$@"
  else
    "$@"
  fi
}

gcloud_args() {
  GCLOUD=(gcloud "$@" "--zone=$ZONE")
  if [[ -n $PROJECT ]]; then GCLOUD+=("--project=$PROJECT"); fi
}

gc() {
  gcloud_args "$@"
  do_cmd "${GCLOUD[@]}"
}

# An scp/ssh: retried, since a VM that just turned ACTIVE may not take ssh yet.
gc_retry() {
  gcloud_args "$@"
  if dry; then
    shell_line "${GCLOUD[@]}"
    return 0
  fi
  local try=1
  until "${GCLOUD[@]}"; do
    ((try < SSH_RETRIES)) || return 1
    note "gcloud ${1:-} ${2:-} ${3:-} ${4:-} failed (try $try of $SSH_RETRIES); again in ${POLL_SECONDS}s"
    try=$((try + 1))
    sleep "$POLL_SECONDS"
  done
}

tpu_ssh() {  # tpu_ssh WORKER COMMAND
  gc_retry compute tpus tpu-vm ssh "$NAME" "--worker=$1" "--command=$2"
}

# --- the queued resource ------------------------------------------------------------------------

describe_args() {
  gcloud_args compute tpus queued-resources describe "$NAME" '--format=value(state.state)'
}

# Prints the QR's state, NOT_FOUND when there is no such QR, UNKNOWN when describe failed else.
qr_state() {
  describe_args
  local out err
  err=$(mktemp)
  if out=$("${GCLOUD[@]}" 2>"$err"); then
    out=${out//[[:space:]]/}
    printf '%s\n' "${out:-UNKNOWN}"
  elif grep -qi 'not.\{0,1\}found' "$err"; then
    echo NOT_FOUND
  else
    echo UNKNOWN
  fi
  rm -f "$err"
}

create_qr() {
  local args=(compute tpus queued-resources create "$NAME" "--node-id=$NAME"
    "--accelerator-type=$ACCELERATOR" "--runtime-version=$RUNTIME")
  if [[ -n $PROVISIONING ]]; then args+=("--$PROVISIONING"); fi
  gc "${args[@]}"
}

# Waits until the QR is ACTIVE: 0; FAILED/SUSPENDED/gone/timeout: one line on stderr and 1.
wait_active() {
  if dry; then
    echo "# repeat until it prints ACTIVE (every ${POLL_SECONDS}s, at most ${TIMEOUT_SECONDS}s):"
    describe_args
    shell_line "${GCLOUD[@]}"
    return 0
  fi
  local start=$SECONDS state last=''
  while :; do
    state=$(qr_state)
    if [[ $state != "$last" ]]; then
      note "queued resource $NAME: $state"
      last=$state
    fi
    case $state in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDING | SUSPENDED | PREEMPTED | NOT_FOUND)
        note "error: queued resource $NAME is $state, not ACTIVE (gcloud compute tpus queued-resources describe $NAME --zone=$ZONE tells why)"
        return 1
        ;;
    esac
    if ((SECONDS - start >= TIMEOUT_SECONDS)); then
      note "error: queued resource $NAME still $state after ${TIMEOUT_SECONDS}s (TPU_TIMEOUT_SECONDS)"
      return 1
    fi
    sleep "$POLL_SECONDS"
  done
}

delete_qr() {
  gc compute tpus queued-resources delete "$NAME" --force --quiet
}

# Waits until describe no longer finds the QR (a name can only be reused then).
wait_gone() {
  dry && return 0
  local start=$SECONDS
  while [[ $(qr_state) != NOT_FOUND ]]; do
    if ((SECONDS - start >= TIMEOUT_SECONDS)); then
      note "error: queued resource $NAME still there ${TIMEOUT_SECONDS}s after delete"
      return 1
    fi
    sleep "$POLL_SECONDS"
  done
}

# --- what runs on the workers -------------------------------------------------------------------

repo_root() { cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd; }

tarball() { printf '%s/resconv_jax-%s.tar.gz\n' "${TMPDIR:-/tmp}" "$NAME"; }

sync_code() {
  local root tar
  root=$(repo_root)
  tar=$(tarball)
  if ! dry && [[ -n $(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    note "warning: uncommitted changes are not synced (git archive HEAD)"
  fi
  do_cmd git -C "$root" archive --format=tar.gz -o "$tar" HEAD || return 1
  gc_retry compute tpus tpu-vm scp "$tar" "$NAME:resconv_jax.tar.gz" --worker=all || return 1
  # Replace the code, keep the venv and the logs.
  tpu_ssh all 'mkdir -p ~/resconv_jax && cd ~/resconv_jax && find . -mindepth 1 -maxdepth 1 ! -name .venv ! -name logs -exec rm -rf {} + && tar -xzf ~/resconv_jax.tar.gz && rm -f ~/resconv_jax.tar.gz' || return 1
  dry || rm -f "$tar"
}

jax_tpu_requirement() {
  local line
  line=$(grep -E '^jax[<>=!~ ]' "$(repo_root)/requirements.txt" | head -n 1) ||
    die "requirements.txt has no jax line"
  line=${line%%#*}
  line=${line//[[:space:]]/}
  printf 'jax[tpu]%s\n' "${line#jax}"
}

setup_workers() {
  local jax_req
  jax_req=$(jax_tpu_requirement) || return 1
  tpu_ssh all "cd ~/resconv_jax && { command -v $PYTHON >/dev/null || { sudo apt-get update -qq && sudo apt-get install -y -qq $PYTHON $PYTHON-venv; }; } && $PYTHON -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q \"$(dq_escape "$jax_req")\" -r requirements.txt && .venv/bin/pip install -q -e ."
}

# The command that starts main on a worker (the same text for every worker).
#   logs/run.log      main's stdout and stderr (the previous start's: logs/run.log.prev)
#   logs/run.pid      the wrapper's PID, also its process group: the next run kills the group
#   logs/exit_status  main's exit status, written when it exits
#   logs/DONE         written before exit_status when main exited 0 and its log has no
#                     "rerun the same command" (the line of a run stopped by SIGTERM/preemption)
# shellcheck disable=SC2016  # the $ in these texts is for the worker's shell
run_command() {
  local flags='' flag wrapper
  for flag in "$@"; do
    flags+=" $(shq "$flag")"
  done
  wrapper="cd ~/resconv_jax && . .venv/bin/activate && python -m resconv_jax.main${flags} >> logs/run.log 2>&1; s=\$?; if [ \$s = 0 ] && ! grep -q rerun.the.same.command logs/run.log; then touch logs/DONE; fi; echo \$s > logs/exit_status.tmp && mv logs/exit_status.tmp logs/exit_status"
  printf '%s' 'cd ~/resconv_jax || exit 1; mkdir -p logs; '
  # A previous run started by this tool: kill its process group (wrapper and main).
  printf '%s' 'p=$(cat logs/run.pid 2>/dev/null) && ps -o args= -p "$p" | grep -q resconv_jax.main && kill -9 -- "-$p"; '
  # Anything else holding the TPU (a stale process from an earlier session), and libtpu's lock.
  printf '%s' 'sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | xargs -r sudo kill -9; sleep 1; sudo rm -f /tmp/libtpu_lockfile; '
  # run.log is created here, before the wrapper starts in the background: a second `run` right
  # after (or one under load) always finds it and keeps it as run.log.prev.
  printf '%s' 'rm -f logs/DONE logs/exit_status; if [ -f logs/run.log ]; then mv logs/run.log logs/run.log.prev; fi; : > logs/run.log; '
  printf 'setsid nohup bash -c "%s" > /dev/null 2>&1 < /dev/null & echo $! > logs/run.pid' "$(dq_escape "$wrapper")"
}

# One line per worker: "resconv-status HOST STATE", STATE one of
#   done | exit N LAST_LOG_LINE | running | lost (started, gone without a status) | none
# shellcheck disable=SC2016  # the $ in this text is for the worker's shell
readonly STATUS_COMMAND='d=~/resconv_jax/logs; if [ -f $d/DONE ]; then s=done; elif [ -f $d/exit_status ]; then s="exit $(cat $d/exit_status) $(tail -n 1 $d/run.log 2>/dev/null)"; elif [ -f $d/run.pid ] && kill -0 "$(cat $d/run.pid)" 2>/dev/null; then s=running; elif [ -f $d/run.pid ]; then s=lost; else s=none; fi; echo "resconv-status $(hostname) $s"'

start_run() {
  tpu_ssh all "$(run_command "$@")"
}

need_main_flags() {
  ((${#MAIN_FLAGS[@]})) || die "$COMMAND needs main's flags after --, e.g. -- --config=configs/jena.py --workdir=gs://BUCKET/jena"
}

# Sets RUN_STATE to done, failed, none, restart, running or unknown (and RUN_DETAIL).
# A worker that exited 5 (main: another process stopped responding or failed), or was killed or
# aborted by JAX (137, 143, 134) while another was lost or exited 5, stopped for that other one:
# the run is rerun on all, as main's line says. Any other non-zero status is the run's failure.
run_state() {
  local out line n=0 done_n=0 none_n=0 restart_n=0 peer_n=0 state failed=''
  RUN_DETAIL=''
  gcloud_args compute tpus tpu-vm ssh "$NAME" --worker=all "--command=$STATUS_COMMAND"
  if ! out=$("${GCLOUD[@]}" 2>/dev/null); then
    RUN_STATE=unknown
    return
  fi
  while IFS= read -r line; do
    [[ $line == 'resconv-status '* ]] || continue
    n=$((n + 1))
    state=${line#resconv-status }
    state=${state#* }
    case $state in
      done) done_n=$((done_n + 1)) ;;
      'exit 0' | 'exit 0 '*) restart_n=$((restart_n + 1)) ;;
      'exit 5' | 'exit 5 '* | lost)
        restart_n=$((restart_n + 1))
        peer_n=$((peer_n + 1))
        ;;
      'exit 134'* | 'exit 137'* | 'exit 143'*)
        restart_n=$((restart_n + 1))
        failed=${failed:-${line#resconv-status }}
        ;;
      exit*)
        RUN_STATE=failed
        RUN_DETAIL=${line#resconv-status }
        return
        ;;
      none) none_n=$((none_n + 1)) ;;
    esac
  done <<<"$out"
  if [[ -n $failed ]] && ((peer_n == 0)); then  # killed or aborted with no lost peer to explain it
    RUN_STATE=failed
    RUN_DETAIL=$failed
    return
  fi
  if ((n == 0)); then
    RUN_STATE=unknown
  elif ((none_n)); then
    RUN_STATE=none
  elif ((restart_n)); then
    RUN_STATE=restart
  elif ((done_n == n)); then
    RUN_STATE='done'
  else
    RUN_STATE=running
  fi
}

# --- commands -------------------------------------------------------------------------------

cmd_create() {
  if ! dry; then
    local state
    state=$(qr_state)
    if [[ $state != NOT_FOUND && $state != UNKNOWN ]]; then
      note "queued resource $NAME exists ($state): not creating it again"
      wait_active || exit 1
      return
    fi
  fi
  create_qr || die "gcloud could not create queued resource $NAME"
  wait_active || exit 1
  dry || note "queued resource $NAME is ACTIVE"
}

cmd_sync() { sync_code || die "sync to $NAME failed"; }

cmd_setup() { setup_workers || die "setup on $NAME failed"; }

cmd_run() {
  need_main_flags
  start_run "${MAIN_FLAGS[@]}" || die "starting the run on $NAME failed"
  dry || note "started on every worker of $NAME (log: ~/resconv_jax/logs/run.log): launch/tpu.sh logs"
}

cmd_logs() {
  tpu_ssh "$WORKER" "tail -n $LOG_LINES ~/resconv_jax/logs/run.log 2>&1 | sed \"s/^/[\$(hostname)] /\""
}

cmd_status() {
  if dry; then
    gc compute tpus queued-resources describe "$NAME" '--format=value(state.state)'
    gc compute tpus tpu-vm ssh "$NAME" --worker=all "--command=$STATUS_COMMAND"
    return
  fi
  local state
  state=$(qr_state)
  echo "queued resource $NAME: $state"
  if [[ $state == ACTIVE ]]; then
    gc compute tpus tpu-vm ssh "$NAME" --worker=all "--command=$STATUS_COMMAND"
  fi
}

cmd_delete() {
  delete_qr
  dry || note "queued resource $NAME deleted"
}

# Creates the QR again and starts the run on it. Fails (1) on any step; babysit then tries again.
recover() {
  local state=$1
  if [[ $state != NOT_FOUND ]]; then
    delete_qr || note "delete of $NAME failed"
    wait_gone || return 1
  fi
  create_qr || return 1
  wait_active || return 1
  sync_code || return 1
  setup_workers || return 1
  start_run "${MAIN_FLAGS[@]}"
}

# "HOST exit N LAST_LOG_LINE" -> one line on stderr, and exit with main's status N.
main_failed() {
  local host=${1%% *} rest status
  rest=${1#"$host" exit }
  status=${rest%% *}
  rest=${rest#"$status"}
  rest=${rest# }
  printf 'tpu.sh: error: main exited with status %s on %s%s; nothing restarted (launch/tpu.sh logs)\n' \
    "$status" "$host" "${rest:+ ($rest)}" >&2
  [[ $status =~ ^[1-9][0-9]*$ ]] && exit "$status"
  exit 1
}

# On an ACTIVE QR: a run never started (none) needs the code and the venv first.
restart_run() {
  if [[ $1 == none ]]; then
    sync_code || return 1
    setup_workers || return 1
  fi
  start_run "${MAIN_FLAGS[@]}"
}

babysit_dry_run() {
  echo "# every ${POLL_SECONDS}s: the state of the queued resource"
  gc compute tpus queued-resources describe "$NAME" '--format=value(state.state)'
  echo "# when ACTIVE: each worker's run state (done on every worker: finished, stop)"
  gc compute tpus tpu-vm ssh "$NAME" --worker=all "--command=$STATUS_COMMAND"
  echo "# when SUSPENDED, PREEMPTED, FAILED or gone: recreate and resume"
  delete_qr
  create_qr
  wait_active
  sync_code
  setup_workers
  start_run "${MAIN_FLAGS[@]}"
}

cmd_babysit() {
  need_main_flags
  if dry; then
    babysit_dry_run
    return
  fi
  local restarts=0 state last=''
  while :; do
    state=$(qr_state)
    case $state in
      ACTIVE)
        run_state
        if [[ "$state/$RUN_STATE" != "$last" ]]; then
          note "queued resource $NAME: ACTIVE, run: $RUN_STATE"
          last="$state/$RUN_STATE"
        fi
        case $RUN_STATE in
          done)
            note "finished: main exited 0 on every worker of $NAME"
            return 0
            ;;
          failed) main_failed "$RUN_DETAIL" ;;
          none | restart)
            restarts=$((restarts + 1))
            ((restarts <= MAX_RESTARTS)) || die "gave up after $MAX_RESTARTS restarts (TPU_MAX_RESTARTS)"
            note "restart $restarts: the run is $RUN_STATE on an ACTIVE $NAME: starting it again"
            if ! restart_run "$RUN_STATE"; then
              note "restart $restarts failed; trying again"
            fi
            last=''
            ;;
        esac
        ;;
      FAILED | SUSPENDING | SUSPENDED | PREEMPTED | NOT_FOUND)
        restarts=$((restarts + 1))
        ((restarts <= MAX_RESTARTS)) || die "gave up after $MAX_RESTARTS restarts (TPU_MAX_RESTARTS)"
        note "restart $restarts: queued resource $NAME is $state: recreating it and resuming the run"
        recover "$state" || note "restart $restarts failed; trying again"
        last=''
        ;;
      *)
        if [[ $state != "$last" ]]; then
          note "queued resource $NAME: $state"
          last=$state
        fi
        ;;
    esac
    sleep "$POLL_SECONDS"
  done
}

main() {
  parse_args "$@"
  [[ -n $COMMAND ]] || {
    usage >&2
    exit 2
  }
  case $COMMAND in
    create | sync | setup | run | logs | status | babysit | delete) ;;
    help) usage; exit 0 ;;
    *) die "unknown command $COMMAND (see -h)" ;;
  esac
  check_options
  "cmd_$COMMAND"
}

main "$@"
