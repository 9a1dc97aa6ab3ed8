#!/usr/bin/env bash
# Start this node's share of a multi-node job; run it once on every node.
#
#   launch/multinode.sh NNODES NODE_RANK HEAD_ADDR[:PORT] [NPROC_PER_NODE] -- [--max-restarts R] [train args ...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multinode.sh -- [train args ...]
#
# Positional values win; missing ones come from the environment: NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (default 29500), NPROC_PER_NODE (default: the visible GPUs, else 1),
# RDZV_ID (default "trinity-train"; give each concurrent job its own), MAX_RESTARTS (default 3,
# see launch/restarts.sh). Under SLURM, NNODES and NODE_RANK default to SLURM_JOB_NUM_NODES and
# SLURM_NODEID.
#
# The nodes meet at a c10d rendezvous on HEAD_ADDR:PORT, hosted by node 0 (its torchrun serves
# the store); every node must reach that address. Example, two nodes:
#   head$   launch/multinode.sh 2 0 10.0.0.1 8 -- --config configs/mini.toml
#   other$  launch/multinode.sh 2 1 10.0.0.1 8 -- --config configs/mini.toml
set -euo pipefail

usage="usage: launch/multinode.sh NNODES NODE_RANK HEAD_ADDR[:PORT] [NPROC_PER_NODE] -- [train args]"
positional=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    positional+=("$1")
    shift
done
[[ $# -gt 0 ]] && shift  # the "--"

nnodes="${positional[0]:-${NNODES:-${SLURM_JOB_NUM_NODES:-}}}"
node_rank="${positional[1]:-${NODE_RANK:-${SLURM_NODEID:-}}}"
head="${positional[2]:-${MASTER_ADDR:-}}"
nproc="${positional[3]:-${NPROC_PER_NODE:-}}"
if [[ -z "$nproc" ]]; then
    nproc="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
    [[ "$nproc" -gt 0 ]] || nproc=1
fi
if [[ "$head" == *:* ]]; then
    port="${head##*:}"
    head="${head%:*}"
else
    port="${MASTER_PORT:-29500}"
fi

for pair in "NNODES:$nnodes" "NODE_RANK:$node_rank" "NPROC_PER_NODE:$nproc" "PORT:$port"; do
    [[ "${pair#*:}" =~ ^[0-9]+$ ]] || { echo "launch/multinode.sh: ${pair%%:*} is missing or not a number" >&2; echo "$usage" >&2; exit 2; }
done
[[ -n "$head" ]] || { echo "launch/multinode.sh: the head address is missing (HEAD_ADDR or MASTER_ADDR)" >&2; echo "$usage" >&2; exit 2; }
(( node_rank < nnodes )) || { echo "launch/multinode.sh: NODE_RANK=$node_rank must be below NNODES=$nnodes" >&2; exit 2; }

source "$(dirname "$0")/restarts.sh"

# An impossible layout for the whole job fails here, with one line, before anything starts.
python -m trinity_train.parallel.preflight "$((nnodes * nproc))" ${train_args[@]+"${train_args[@]}"}
# Node 0 hosts the rendezvous store; saying so explicitly also works when several "nodes" share
# one machine (tests, or a quick check on a workstation).
is_host=$([[ "$node_rank" == 0 ]] && echo true || echo false)
# A failed worker on any node restarts every node's workers (torchrun's re-rendezvous).
exec torchrun --nnodes="$nnodes" --nproc-per-node="$nproc" --max-restarts="$max_restarts" \
    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="${RDZV_ID:-trinity-train}" \
    --rdzv-conf="is_host=$is_host" \
    -m trinity_train.cli train ${train_args[@]+"${train_args[@]}"}
