#!/usr/bin/env bash
# Train on one node with N processes (N GPUs, or N gloo ranks on the CPU).
#
#   launch/local.sh N [--max-restarts R] [--config FILE] [--section.key=value ...]
#   launch/local.sh N calibrate [--out PROFILE] [--time-limit S] [--config FILE] [--section.key=value ...]
#
# Everything after N (but --max-restarts, see launch/restarts.sh) goes to `trinity-train train`;
# the layout comes from the config, e.g.
#   launch/local.sh 4 --parallel.tp=2            # tp 2 x FSDP 2
#   launch/local.sh 8 --parallel.ep=4            # experts over 4 ranks, FSDP over all 8
# N defaults to the number of visible GPUs when given as "gpus". TRAIN_MODULE: the module each rank
# runs (default trinity_train.cli; the benchmarks' trinity_harness.train_instrumented measures it).
set -euo pipefail

usage="usage: launch/local.sh N|gpus [--max-restarts R] [calibrate] [--config FILE] [--section.key=value ...]"
nproc="${1:?$usage}"
shift
if [[ "$nproc" == "gpus" ]]; then
    nproc="$(nvidia-smi --list-gpus 2>/dev/null | wc -l)"
    [[ "$nproc" -gt 0 ]] || { echo "launch/local.sh: no GPU visible; give the process count" >&2; exit 2; }
fi
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "$usage" >&2; exit 2; }
source "$(dirname "$0")/restarts.sh"

# An impossible layout for N processes fails here, with one line, before anything starts
# (calibrate checks the job's layout itself: its own options are not training's).
if [[ "$command" == train ]]; then
    python -m trinity_train.parallel.preflight --ranks-per-node "$nproc" "$nproc" ${train_args[@]+"${train_args[@]}"}
fi
# --standalone: a private c10d rendezvous on a free local port, so several jobs can share a node.
run_torchrun --standalone --nnodes=1 --nproc-per-node="$nproc" --max-restarts="$max_restarts" \
    -m "${TRAIN_MODULE:-trinity_train.cli}" "$command" ${train_args[@]+"${train_args[@]}"}
