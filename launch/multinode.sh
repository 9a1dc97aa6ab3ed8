#!/usr/bin/env bash
# Start this node's share of a multi-node job; run it once on every node.
#
#   launch/multinode.sh NNODES NODE_RANK HEAD_ADDR[:PORT] [NPROC_PER_NODE] -- [--max-restarts R] [train args ...]
#   launch/multinode.sh NNODES NODE_RANK HEAD_ADDR[:PORT] [NPROC_PER_NODE] -- calibrate [calibrate args ...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multinode.sh -- [train args ...]
#
# Positional values win; missing ones come from the environment: NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (default 29500), NPROC_PER_NODE (default: the visible GPUs, else 1),
# RDZV_ID (default "trinity-train"; give each concurrent job its own), MAX_RESTARTS (default 3,
# see launch/restarts.sh), NODE_ADDR (the address this node advertises; default: the source address
# of its route to the head), RDZV_LAST_CALL_S (elastic NNODES=MIN:MAX: how long a rendezvous that
# has MIN nodes waits for more, default 30), TRAIN_MODULE (the module each rank runs, default
# trinity_train.cli; the benchmarks' trinity_harness.train_instrumented measures it). Under SLURM, NNODES and NODE_RANK default to SLURM_JOB_NUM_NODES and
# SLURM_NODEID.
#
# The nodes meet at a c10d rendezvous on HEAD_ADDR:PORT, hosted by node 0 (its torchrun serves
# the store); every node must reach that address. Example, two nodes:
#   head$   launch/multinode.sh 2 0 10.0.0.1 8 -- --config configs/mini.toml
#   other$  launch/multinode.sh 2 1 10.0.0.1 8 -- --config configs/mini.toml
set -euo pipefail

usage="usage: launch/multinode.sh NNODES NODE_RANK HEAD_ADDR[:PORT] [NPROC_PER_NODE] -- [calibrate] [train args]"
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

# NNODES may be a range MIN:MAX (elastic): the job runs on as many nodes as are up, at least MIN;
# a lost node's share is taken over by the rest and a node that comes back joins at the next
# rendezvous. The ranks keep train.global_batch_size's batches (set it for elastic jobs).
min_nodes="${nnodes%%:*}"
max_nodes="${nnodes##*:}"
for pair in "NNODES:$min_nodes" "NNODES:$max_nodes" "NODE_RANK:$node_rank" "NPROC_PER_NODE:$nproc" "PORT:$port"; do
    [[ "${pair#*:}" =~ ^[0-9]+$ ]] || { echo "launch/multinode.sh: ${pair%%:*} is missing or not a number" >&2; echo "$usage" >&2; exit 2; }
done
[[ -n "$head" ]] || { echo "launch/multinode.sh: the head address is missing (HEAD_ADDR or MASTER_ADDR)" >&2; echo "$usage" >&2; exit 2; }
(( min_nodes >= 1 && min_nodes <= max_nodes )) || { echo "launch/multinode.sh: NNODES=$nnodes: a range must be MIN:MAX with 1 <= MIN <= MAX" >&2; exit 2; }
(( node_rank < max_nodes )) || { echo "launch/multinode.sh: NODE_RANK=$node_rank must be below NNODES=$max_nodes" >&2; exit 2; }

source "$(dirname "$0")/restarts.sh"

# This node's side of the network: the address it advertises to the other nodes and the interface
# gloo / NCCL bind to. torchrun otherwise advertises the machine's hostname, which another node may
# not resolve or may resolve to an interface it cannot reach (pytorch#107021, #69197): the
# rendezvous then completes and the workers hang connecting to each other. Both come from the
# route to the head (the source address and device the kernel picks), unless NODE_ADDR,
# GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME are set.
head_ip="$head"
if [[ ! "$head" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    head_ip="$(getent ahostsv4 "$head" | awk 'NR == 1 {print $1}' || true)"
    [[ -n "$head_ip" ]] || { echo "launch/multinode.sh: the head '$head' does not resolve to an address on this node ($(hostname)); give its IP address" >&2; exit 1; }
fi
route="$(ip -o route get "$head_ip" 2>&1)" || { echo "launch/multinode.sh: no route from this node ($(hostname)) to the head $head_ip:$port: ${route//$'\n'/ }" >&2; exit 1; }
route_src="$(awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}' <<<"$route" | head -n 1)"
route_dev="$(awk '{for (i = 1; i < NF; i++) if ($i == "dev") print $(i + 1)}' <<<"$route" | head -n 1)"
if [[ "$route_dev" == lo && "$head_ip" != 127.* ]]; then
    # The head is this node: the interface is the one that holds the address, not loopback.
    route_dev="$(ip -o addr show to "$head_ip" | awk 'NR == 1 {print $2}')"
fi
node_addr="${NODE_ADDR:-$route_src}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$route_dev}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$route_dev}"

# An impossible layout for the whole job fails here, with one line, before anything starts (with
# NPROC_PER_NODE ranks per node: tp and ep groups inside a node, unless
# parallel.allow_ep_tp_across_nodes); it also says how long joining may take (parallel.init_timeout_s).
# (calibrate checks the job's layout itself, and waits for the other nodes up to CALIBRATE_WAIT_S.)
if [[ "$command" == train ]]; then
    init_timeout="$(python -m trinity_train.parallel.preflight --print-init-timeout --ranks-per-node "$nproc" "$((max_nodes * nproc))" ${train_args[@]+"${train_args[@]}"})"
else
    init_timeout="${CALIBRATE_WAIT_S:-300}"
fi
if [[ "$command" == train ]] && (( min_nodes < max_nodes )); then
    python -m trinity_train.parallel.preflight --ranks-per-node "$nproc" "$((min_nodes * nproc))" ${train_args[@]+"${train_args[@]}"}
fi

# A node other than the head waits for the head's rendezvous port, bounded by the init timeout,
# and fails in one line when it never opens, instead of torchrun's long retries and traceback.
if [[ "$node_rank" != 0 ]]; then
    deadline=$(( SECONDS + ${init_timeout%.*} ))
    until timeout 2 bash -c ": >/dev/tcp/$head_ip/$port" 2>/dev/null; do
        if (( SECONDS >= deadline )); then
            echo "launch/multinode.sh: the head $head_ip:$port did not answer from this node ($(hostname), $node_addr) within ${init_timeout%.*} s (parallel.init_timeout_s); is node 0 started, and are the address and port right?" >&2
            exit 1
        fi
        sleep 1
    done
fi

# Node 0 hosts the rendezvous store; saying so explicitly also works when several "nodes" share
# one machine (tests, or a quick check on a workstation).
is_host=$([[ "$node_rank" == 0 ]] && echo true || echo false)
# A failed worker on any node restarts every node's workers (torchrun's re-rendezvous).
run_torchrun --nnodes="$nnodes" --nproc-per-node="$nproc" --max-restarts="$max_restarts" \
    --rdzv-backend=c10d --rdzv-endpoint="$head_ip:$port" --rdzv-id="${RDZV_ID:-trinity-train}" \
    --rdzv-conf="is_host=$is_host,last_call_timeout=${RDZV_LAST_CALL_S:-30}" --local-addr="$node_addr" \
    -m "${TRAIN_MODULE:-trinity_train.cli}" "$command" ${train_args[@]+"${train_args[@]}"}
