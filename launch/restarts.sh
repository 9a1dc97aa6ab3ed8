# Sourced by the launchers: how torchrun restarts a failed job. Defines `max_restarts`,
# `train_args` (the arguments with a launcher-level --max-restarts N / --max-restarts=N taken out),
# `command` (what each rank runs: `train`, or `calibrate` when the arguments start with it) and
# `run_torchrun ARGS...`, which runs torchrun and ends the launcher with its outcome.
#
# When a worker dies (a crash, SIGKILL, a collective that times out), torchrun stops every worker
# and starts them all again, up to max_restarts times (the MAX_RESTARTS environment variable, or
# --max-restarts; default 3; 0 disables). A restarted run resumes from its newest sound checkpoint
# whatever checkpoint.resume says (trinity_train/checkpoint/manager.py), so it loses at most the
# steps since that checkpoint.
#
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.13's c10d rendezvous hands the restarted workers the
# same TCPStore as the attempt that failed, and gloo can then read a dead worker's address and fail
# ("connectFullMesh ... Connection refused") or wait; with it, every attempt gets a fresh store
# (benchmarks/restart_repro.py reproduces it; benchmarks/README.md has the measurements).
max_restarts="${MAX_RESTARTS:-3}"
train_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --max-restarts=*) max_restarts="${1#*=}" ;;
        --max-restarts) max_restarts="${2:-}"; shift ;;
        *) train_args+=("$1") ;;
    esac
    shift
done
# `calibrate` first: the ranks measure the nodes (trinity-train calibrate) instead of training, once
# (a measurement that failed is rerun by hand, not restarted).
command=train
if [[ ${#train_args[@]} -gt 0 && "${train_args[0]}" == calibrate ]]; then
    command=calibrate
    train_args=("${train_args[@]:1}")
    max_restarts=0
fi
[[ "$max_restarts" =~ ^[0-9]+$ ]] || { echo "launcher: --max-restarts must be a number >= 0, got '$max_restarts'" >&2; exit 2; }
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# run_torchrun ARGS...: torchrun with ARGS, then exit with its status (trinity_train/exit_codes.py),
# except that
# - a user mistake is not restarted: a worker that meets one (a config the nodes disagree on, a
#   checkpoint that does not fit) leaves its exit code and one-line message in
#   $TRINITY_LAUNCHER_VERDICT and exits 0 (trinity_train/launcher_verdict.py); the launcher prints
#   the lowest rank's line and exits with its code (2 configuration, 3 diverged, 1 otherwise);
# - a restartable failure (the hang watchdog, a lost peer) that torchrun had no restart left for
#   exits 75 (EX_TEMPFAIL), so a scheduler requeues it: the worker left
#   restartable-<attempt>-rank<RANK> in the folder, and the last attempt is number max_restarts
#   (torchrun gives up only once every restart failed). Any other failure is torchrun's 1.
# Signals reach torchrun, which stops its workers (a background job of a script ignores SIGINT,
# hence the trap).
run_torchrun() {
    local verdict status=0 pid
    verdict="$(mktemp -d -t trinity-verdict.XXXXXX)"
    trap 'rm -rf "$verdict"' EXIT
    TRINITY_LAUNCHER_VERDICT="$verdict" torchrun "$@" &
    pid=$!
    trap 'kill -TERM "$pid" 2>/dev/null || true' TERM INT HUP
    # `wait` returns early when a trapped signal arrives; wait again until torchrun has exited.
    while true; do
        wait "$pid" && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    local first
    first="$(find "$verdict" -name 'rank*' ! -name '*.tmp' | sort | head -n 1)"
    if [[ -n "$first" ]]; then
        local code message
        IFS=$'\t' read -r code message <"$first"
        echo "error: $message" >&2
        exit "$code"
    fi
    if [[ "$status" != 0 ]]; then
        local restartable
        restartable="$(find "$verdict" -name "restartable-${max_restarts}-rank*" ! -name '*.tmp' | sort | head -n 1)"
        if [[ -n "$restartable" ]]; then
            echo "launcher: torchrun gave up after $max_restarts restart(s); the last attempt failed restartably ($(head -n 1 "$restartable")); exiting 75 so that a scheduler requeues the job" >&2
            exit 75
        fi
    fi
    exit "$status"
}
