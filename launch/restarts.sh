# Sourced by the launchers: how torchrun restarts a failed job. Defines `max_restarts` and
# `train_args` (the arguments with a launcher-level --max-restarts N / --max-restarts=N taken out).
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
[[ "$max_restarts" =~ ^[0-9]+$ ]] || { echo "launcher: --max-restarts must be a number >= 0, got '$max_restarts'" >&2; exit 2; }
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
