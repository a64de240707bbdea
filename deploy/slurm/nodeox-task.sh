#!/usr/bin/env bash
# What the Slurm jobs of deploy/slurm/ share (docs/clusters.md, "15. On Slurm").
#
#   nodeox-task.sh coordinator   run `nodeox coordinator` on NODEOX_RUN_DIR; write its address to ADDRESS_FILE
#   nodeox-task.sh host          one Slurm task = one host (one node, or NODES_PER_HOST nodes): wait for the
#                                coordinator's address, set NODEOX_*, exec torchrun (or python for one GPU)
#
# Sourced by the .sbatch scripts for start_step and wait_all (signals and requeue). Every setting is an environment
# variable with its default here; sbatch and srun pass the submitting shell's environment on (--export=ALL).
set -euo pipefail

: "${NODEOX_RUN_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/runs/nodeox}"  # the run directory: on storage every node mounts
: "${TOKEN_FILE:=$NODEOX_RUN_DIR/token}"           # made by the coordinator's job when missing (mode 600)
: "${ADDRESS_FILE:=$NODEOX_RUN_DIR/coordinator.url}"  # the coordinator's URL, for the hosts' jobs
: "${COORDINATOR_PORT:=8470}"                      # 0: any free port (the address file says which)
: "${COORDINATOR_HOST:=$(hostname)}"               # the name hosts reach the coordinator's node by
: "${COORDINATOR_ARGS:=}"                          # more `nodeox coordinator` flags, e.g. "--min-hosts 6"
: "${TLS_CERT:=}"                                  # with TLS_KEY: serve https (hosts trust CA_FILE)
: "${TLS_KEY:=}"
: "${CA_FILE:=$TLS_CERT}"                          # NODEOX_CA_FILE of the hosts (a self-signed certificate)
: "${TRAIN:=train.py}"                             # the host's training script and its arguments
: "${GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"     # torchrun --nproc-per-node (1: python, no torchrun)
: "${NODES_PER_HOST:=1}"                           # >1: one host spans that many nodes (Trainer(num_nodes=M))
: "${RDZV_PORT:=29500}"                            # torchrun's rendezvous on a host's first node
: "${HOST_ID_OFFSET:=0}"                           # host ids start here (several host jobs in one run)
: "${ADDRESS_WAIT:=3600}"                          # seconds a host waits for ADDRESS_FILE and TOKEN_FILE
: "${ADDRESS_POLL:=2}"                             # seconds between looks

say() { echo "nodeox-task: $*" >&2; }
die() { say "$*"; exit 2; }

# Signals, while a job's work runs in the background behind start_process / start_step and wait_all:
# - SIGTERM (preemption, scancel): Slurm signals every step itself; a process of the batch step started here
#   gets it again, which changes nothing. An srun is never sent SIGTERM: it would SIGKILL its tasks.
# - SIGUSR1 (sbatch --signal=B:USR1@S: the time limit is near; Slurm signals the batch script alone): SIGTERM to
#   the processes started here and, through `scancel --signal=TERM JOBID`, to every task of the job's steps; once
#   they have stopped, the job requeues itself (Slurm requeues a preempted job by itself, and never a cancelled one).
_processes=()
_steps=()
_requeue=0

start_process() {  # CMD... in the background, in this job step (the traps first: a signal never finds none)
    _traps
    "$@" &
    _processes+=("$!")
}

start_step() {  # srun ... in the background: a job step (the traps first, as above)
    _traps
    "$@" &
    _steps+=("$!")
}

_traps() {
    trap '_stop' TERM
    trap '_requeue=1; _stop; _stop_steps' USR1
}

_stop() {
    (( ${#_processes[@]} == 0 )) || kill -TERM "${_processes[@]}" 2>/dev/null || true
}

_stop_steps() {
    (( ${#_steps[@]} == 0 )) || scancel --signal=TERM "$SLURM_JOB_ID" || say "scancel --signal=TERM failed"
}

wait_all() {  # until everything started has ended, then requeue if asked; the last failing one's status (else 0)
    local status=0 pid
    for pid in "${_processes[@]}" "${_steps[@]}"; do
        while kill -0 "$pid" 2>/dev/null; do
            wait "$pid" || true  # returns early when a trapped signal arrives
        done
        wait "$pid" || status=$?
    done
    trap - TERM USR1
    _processes=() _steps=()
    if [[ $_requeue == 1 && -n ${SLURM_JOB_ID:-} ]]; then
        say "the time limit is near: requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || say "scontrol requeue $SLURM_JOB_ID failed"
    fi
    return "$status"
}

# The URL a coordinator with pid PID listens on, once RUN_DIR/coordinator.json (written when it listens) is its.
_listening_url() {
    local info="$NODEOX_RUN_DIR/coordinator.json"
    [[ -f $info ]] && grep -Eq "\"pid\": $1[,}]" "$info" && sed -nE 's/.*"url": *"([^"]*)".*/\1/p' "$info"
}

coordinator() {
    [[ -n ${HOSTS:-} ]] || die "HOSTS is not set: the number of hosts in the run (HOSTS=8 sbatch ...)"
    mkdir -p "$NODEOX_RUN_DIR"
    if [[ ! -s $TOKEN_FILE ]]; then
        (umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$TOKEN_FILE")
        say "made the run's token in $TOKEN_FILE"
    fi
    rm -f "$ADDRESS_FILE"  # a previous job's address: hosts wait for this one's
    local args=(coordinator --hosts "$HOSTS" --run-dir "$NODEOX_RUN_DIR" --bind "0.0.0.0:$COORDINATOR_PORT"
                --token-file "$TOKEN_FILE")
    [[ -z $TLS_CERT ]] || args+=(--tls-cert "$TLS_CERT" --tls-key "$TLS_KEY")
    local extra
    read -r -a extra <<< "$COORDINATOR_ARGS"
    # started again on the same run directory (a requeue), the coordinator resumes the run by itself
    start_process nodeox "${args[@]}" "${extra[@]}"
    local pid=${_processes[-1]} url=""
    while kill -0 "$pid" 2>/dev/null && ! url=$(_listening_url "$pid"); do
        sleep 0.2
    done
    if [[ -n $url ]]; then
        local scheme=${url%%://*} port=${url##*:}
        echo "$scheme://$COORDINATOR_HOST:$port" > "$ADDRESS_FILE.tmp"
        mv -f "$ADDRESS_FILE.tmp" "$ADDRESS_FILE"
        say "coordinator at $(< "$ADDRESS_FILE") (written to $ADDRESS_FILE)"
    fi
    local status=0
    wait_all || status=$?
    [[ -z $url ]] || rm -f "$ADDRESS_FILE"  # this job's address only (a second coordinator on RUN_DIR exits at once)
    return "$status"
}

# Wait for a non-empty FILE (written by the coordinator's job).
_wait_for() {
    local deadline=$(( SECONDS + ADDRESS_WAIT ))
    until [[ -s $1 ]]; do
        (( SECONDS < deadline )) || die "no $1 after $ADDRESS_WAIT s: is the coordinator's job running?"
        sleep "$ADDRESS_POLL"
    done
}

host() {
    local procid=${SLURM_PROCID:?run under srun (SLURM_PROCID is not set)}
    local tasks=${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:?}} nodes=${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:?}}
    (( tasks == nodes )) || die "$tasks tasks on $nodes nodes: give srun --ntasks-per-node=1 (one task per node)"
    (( tasks % NODES_PER_HOST == 0 )) || die "$tasks nodes do not make hosts of NODES_PER_HOST=$NODES_PER_HOST"
    # SLURM_PROCID (0..N-1) is the task's rank in the step, the same after a requeue whatever nodes the job gets
    # (a hostname is not), so a requeued host rejoins under its id
    local index=$(( procid / NODES_PER_HOST ))
    export NODEOX_HOST_ID=$(( HOST_ID_OFFSET + index ))
    export NODEOX_NUM_HOSTS=${NODEOX_NUM_HOSTS:-${HOSTS:-$(( tasks / NODES_PER_HOST ))}}
    export NODEOX_RUN_DIR  # each host's logs and checkpoints: RUN_DIR/hosts/host<id>/
    [[ -z $CA_FILE ]] || export NODEOX_CA_FILE=$CA_FILE
    _wait_for "$ADDRESS_FILE"
    _wait_for "$TOKEN_FILE"
    NODEOX_COORDINATOR_URL=$(< "$ADDRESS_FILE")
    NODEOX_TOKEN=$(< "$TOKEN_FILE")
    export NODEOX_COORDINATOR_URL NODEOX_TOKEN
    local train
    read -r -a train <<< "$TRAIN"
    if (( NODES_PER_HOST > 1 )); then
        local first head
        first=$(( index * NODES_PER_HOST ))
        head=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | sed -n "$(( first + 1 ))p")
        say "host $NODEOX_HOST_ID: node $(( procid - first )) of $NODES_PER_HOST, rendezvous at $head:$RDZV_PORT"
        exec torchrun --nnodes "$NODES_PER_HOST" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d \
            --rdzv-endpoint "$head:$RDZV_PORT" --rdzv-id "${SLURM_JOB_ID:-nodeox}-$NODEOX_HOST_ID" "${train[@]}"
    elif (( GPUS_PER_NODE > 1 )); then
        exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" "${train[@]}"
    else
        exec python "${train[@]}"
    fi
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    case "${1:-}" in
        coordinator) coordinator ;;
        host) host ;;
        *) die "usage: nodeox-task.sh coordinator|host" ;;
    esac
fi
