#!/usr/bin/env bash
# A cluster on one machine: N hosts, each a network namespace with its own hostname (a UTS
# namespace), joined by a bridge, to rehearse multi-node jobs on real sockets between separate
# network stacks. The tests use it as their fixture; needs root and iproute2 (`ip`, `tc`).
#
#   launch/cluster.sh up N                 make hosts ttnode0 .. ttnode{N-1} at 10.213.0.1 .. .N
#   launch/cluster.sh exec HOST CMD ...    run CMD on HOST (its network, hostname and /etc/hosts)
#   launch/cluster.sh shape HOST [delay=2ms] [rate=200mbit] [loss=0.1%] [queue=100ms]   shape HOST's link, both
#                                          directions (netem; where the kernel lacks netem, only
#                                          rate=, with tbf, and queue=100ms its queue's length
#                                          in time); `shape HOST off` removes it
#   launch/cluster.sh partition HOST       cut HOST's link (packets dropped, its sockets time out)
#   launch/cluster.sh heal HOST            reconnect it
#   launch/cluster.sh hosts                print "NAME ADDRESS" per host
#   launch/cluster.sh slurm up|down        SLURM on the hosts (launch/cluster_slurm.sh)
#   launch/cluster.sh down                 remove everything `up` made (idempotent; also after a crash)
#
# Network rule: every address is one the bed assigns inside namespaces it creates. The hosts have
# their own loopback and one link each to a bridge that lives in a namespace of its own
# (${prefix}switch); there is no default route, no NAT and no link to the machine's interfaces,
# so a packet for any other address has no route and is never sent.
#
# Environment: TRINITY_CLUSTER_PREFIX (default "tt": hosts ttnode0.., switch ttswitch),
# TRINITY_CLUSTER_SUBNET (default 10.213.0, a /24), TRINITY_CLUSTER_STATE (default
# /run/trinity-cluster-$prefix: what `up` made, read by `down`).
set -euo pipefail

prefix="${TRINITY_CLUSTER_PREFIX:-tt}"
subnet="${TRINITY_CLUSTER_SUBNET:-10.213.0}"
state="${TRINITY_CLUSTER_STATE:-/run/trinity-cluster-$prefix}"
switch="${prefix}switch"
me="launch/cluster.sh"

die() { echo "$me: $*" >&2; exit "${code:-1}"; }
host_name() { echo "${prefix}node$1"; }
host_addr() { echo "$subnet.$(( $1 + 1 ))"; }
host_index() {  # HOST -> its index, or fail in one line
    local name="$1" index
    [[ -f "$state/hosts" ]] || die "no cluster is up (run '$me up N' first)"
    index="$(awk -v h="$name" '$1 == h {print $3}' "$state/hosts")"
    [[ -n "$index" ]] || die "no host '$name' in the cluster (hosts: $(awk '{printf "%s ", $1}' "$state/hosts"))"
    echo "$index"
}

need_tools() {
    [[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, links, tc)"
    local tool
    for tool in ip tc nsenter unshare; do
        command -v "$tool" >/dev/null || die "'$tool' is missing: apt-get install -y iproute2 util-linux"
    done
}

cmd_up() {
    local n="${1:-}"
    [[ "$n" =~ ^[1-9][0-9]*$ ]] && (( n <= 200 )) || code=2 die "up needs a host count from 1 to 200, got '${n}'"
    need_tools
    [[ ! -e "$state" ]] || die "a cluster is already up ($state exists): run '$me down' first"
    mkdir -p "$state/uts"
    # Whatever fails from here on, take down what was made so far.
    trap 'cmd_down >/dev/null 2>&1 || true' ERR
    ip netns add "$switch"
    ip -n "$switch" link add br0 type bridge
    ip -n "$switch" link set br0 up
    local i name addr
    : >"$state/hosts"
    for ((i = 0; i < n; i++)); do
        echo "$(host_name "$i") $(host_addr "$i") $i" >>"$state/hosts"
    done
    for ((i = 0; i < n; i++)); do
        name="$(host_name "$i")"
        addr="$(host_addr "$i")"
        ip netns add "$name"
        # The pair is made directly in the two namespaces: no end ever sits in the machine's own.
        ip link add eth0 netns "$name" type veth peer name "port$i" netns "$switch"
        ip -n "$name" link set lo up
        ip -n "$name" addr add "$addr/24" dev eth0
        ip -n "$name" link set eth0 up
        ip -n "$switch" link set "port$i" master br0 up
        mkdir -p "/etc/netns/$name"
        { echo "127.0.0.1 localhost"; awk '{print $2, $1}' "$state/hosts"; } >"/etc/netns/$name/hosts"
        # No name server: a name the hosts file lacks fails at once instead of asking the machine's.
        echo "# trinity-train cluster bed: names resolve through /etc/hosts only" >"/etc/netns/$name/resolv.conf"
        sed 's/^hosts:.*/hosts: files/' /etc/nsswitch.conf >"/etc/netns/$name/nsswitch.conf"
        touch "$state/uts/$name"
        unshare --uts="$state/uts/$name" hostname "$name"
    done
    trap - ERR
    echo "cluster up: $n hosts"
    cmd_hosts
}

cmd_hosts() {
    [[ -f "$state/hosts" ]] || die "no cluster is up (run '$me up N' first)"
    awk '{print $1, $2}' "$state/hosts"
}

cmd_exec() {
    local host="${1:-}"
    [[ -n "$host" && $# -ge 2 ]] || code=2 die "usage: $me exec HOST CMD ..."
    host_index "$host" >/dev/null
    shift
    # ip netns exec gives the command the host's network and its /etc/netns files (hosts,
    # resolv.conf); nsenter its hostname.
    exec nsenter --uts="$state/uts/$host" -- ip netns exec "$host" "$@"
}

cmd_shape() {
    local host="${1:-}"
    [[ -n "$host" && $# -ge 2 ]] || code=2 die "usage: $me shape HOST [delay=D] [rate=R] [loss=P] [queue=Q] | off"
    local index
    index="$(host_index "$host")"
    shift
    if [[ "$1" == "off" ]]; then
        tc -n "$host" qdisc del dev eth0 root 2>/dev/null || true
        tc -n "$switch" qdisc del dev "port$index" root 2>/dev/null || true
        return
    fi
    local netem=() rate="" queue="" arg
    for arg in "$@"; do
        case "$arg" in
            delay=*|loss=*) netem+=("${arg%%=*}" "${arg#*=}") ;;
            rate=*) rate="${arg#*=}" ;;
            queue=*) queue="${arg#*=}" ;;
            *) code=2 die "shape: unknown setting '$arg' (delay=2ms, rate=200mbit, loss=0.1%, queue=100ms)" ;;
        esac
    done
    local qdisc=()
    if has_netem; then
        [[ -z "$queue" ]] || code=2 die "shape: queue= sets tbf's queue, used where the kernel has no netem; this one has netem"
        qdisc=(netem "${netem[@]}" ${rate:+rate "$rate"})
    elif [[ ${#netem[@]} -gt 0 ]]; then
        code=2 die "shape: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is off), so delay and loss cannot be shaped here; rate=... alone works (tbf)"
    elif [[ -z "$rate" ]]; then
        code=2 die "shape: nothing to shape; give rate=R (e.g. rate=200mbit)"
    else
        # Without netem, a token bucket at the rate (256 KB: more than a timer tick of 1 Gbit)
        # before a queue of `queue` (default 100 ms). `python benchmarks/bed_link.py` measures
        # what bulk TCP gets through it, one stream and two opposite ones, per queue length.
        qdisc=(tbf rate "$rate" burst 256kb latency "${queue:-100ms}")
    fi
    # Both directions: the host's egress and the switch port's egress toward it.
    tc -n "$host" qdisc replace dev eth0 root "${qdisc[@]}"
    tc -n "$switch" qdisc replace dev "port$index" root "${qdisc[@]}"
}

has_netem() {  # the qdisc is a kernel option (sch_netem); ask the kernel on the switch's bridge
    if tc -n "$switch" qdisc add dev br0 root netem delay 0ms 2>/dev/null; then
        tc -n "$switch" qdisc del dev br0 root
        return 0
    fi
    return 1
}

cmd_partition() {
    local host="${1:-}" index
    index="$(host_index "$host")"
    # The switch side goes down: the host keeps its address and route (NO-CARRIER), so its
    # packets are dropped and its peers' connections time out, as behind a failed switch port.
    ip -n "$switch" link set "port$index" down
}

cmd_heal() {
    local host="${1:-}" index
    index="$(host_index "$host")"
    ip -n "$switch" link set "port$index" up
}

cmd_down() {
    local name
    # SLURM started on the bed (launch/cluster_slurm.sh) first: its jobs ended, its daemons stopped.
    [[ ! -d "$state/slurm" ]] || TRINITY_CLUSTER_PREFIX="$prefix" TRINITY_CLUSTER_STATE="$state" \
        "$(dirname "$0")/cluster_slurm.sh" down 2>/dev/null || true
    # Hosts of the state file and any namespace with the bed's names (a crash before the state
    # was written): processes first, then the namespace (which removes its links), hostname, files.
    local names
    names="$( { [[ -f "$state/hosts" ]] && awk '{print $1}' "$state/hosts"; ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}node[0-9]+$"; } | sort -u || true)"
    for name in $names "$switch"; do
        if ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$name"; then
            local pids
            pids="$(ip netns pids "$name" 2>/dev/null || true)"
            [[ -z "$pids" ]] || kill -9 $pids 2>/dev/null || true
            ip netns delete "$name" 2>/dev/null || true
        fi
        if [[ -e "$state/uts/$name" ]]; then
            umount "$state/uts/$name" 2>/dev/null || true
        fi
        [[ "$name" == "$switch" ]] || rm -rf "/etc/netns/$name"
    done
    rm -rf "$state"
    echo "cluster down"
}

command="${1:-}"
[[ $# -gt 0 ]] && shift
case "$command" in
    up) cmd_up "$@" ;;
    exec) cmd_exec "$@" ;;
    shape) cmd_shape "$@" ;;
    partition) cmd_partition "$@" ;;
    heal) cmd_heal "$@" ;;
    hosts) cmd_hosts ;;
    down) cmd_down ;;
    slurm) TRINITY_CLUSTER_PREFIX="$prefix" TRINITY_CLUSTER_STATE="$state" exec "$(dirname "$0")/cluster_slurm.sh" "$@" ;;
    *) code=2 die "usage: $me up N | exec HOST CMD ... | shape HOST [delay=D] [rate=R] [loss=P] [queue=Q]|off | partition HOST | heal HOST | hosts | slurm up|down | down" ;;
esac
