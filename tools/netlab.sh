#!/usr/bin/env bash
# netlab: N "nodes" on one machine, each a network namespace with its own loopback (the fast
# inside of a node) and one veth link to a shared bridge (the slow outside), rate-limited by
# `tc tbf` on every node's link, so multi-node runs see a real heterogeneous network.
#
#   tools/netlab.sh up N RATE DELAY   make nodes 0..N-1 (RATE as tc: 1gbit, 200mbit;
#                                     DELAY as tc: 0.2ms, or 0 for none; needs sch_netem)
#   tools/netlab.sh run NODE CMD...   run CMD inside node NODE, under its own hostname
#                                     ${PREFIX}-node<i> (env NETLAB_NODE, NETLAB_ADDR,
#                                     NETLAB_MASTER_ADDR = node 0's address)
#   tools/netlab.sh addr NODE         print NODE's address
#   tools/netlab.sh bytes NODE        print "RX_BYTES TX_BYTES" of NODE's inter-node link
#   tools/netlab.sh down              remove everything netlab made (idempotent)
#
# Everything lives in namespaces named ${NETLAB_PREFIX:-mzpp}_hub and ${NETLAB_PREFIX}_node<i>;
# the only addresses are ${NETLAB_SUBNET:-10.77.0}.<i+1>/24 inside them. The host's own
# namespace, interfaces and routes are never touched. Each node also gets a hostname (a UTS
# namespace per `run`) and a hosts file (/etc/netns/<ns>/hosts, which `ip netns exec` mounts
# over /etc/hosts) naming every node, so launchers that find "their" address by resolving the
# hostname (torchrun's rendezvous host, gloo) behave as on separate machines.
# Needs root, `ip`, `tc` and `unshare`.
set -euo pipefail

PREFIX="${NETLAB_PREFIX:-mzpp}"
SUBNET="${NETLAB_SUBNET:-10.77.0}"
HUB="${PREFIX}_hub"
MTU="${NETLAB_MTU:-1500}"

die() { echo "netlab: $*" >&2; exit 1; }
node_ns() { echo "${PREFIX}_node$1"; }
node_addr() { echo "${SUBNET}.$(( $1 + 1 ))"; }
node_host() { echo "${PREFIX}-node$1"; }

require_tools() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces and tc need CAP_NET_ADMIN)"
  command -v ip >/dev/null || die "'ip' (iproute2) not found"
  command -v tc >/dev/null || die "'tc' (iproute2) not found"
  command -v unshare >/dev/null || die "'unshare' (util-linux) not found"
}

check_node() {
  [[ "$1" =~ ^[0-9]+$ ]] || die "NODE must be a number, got '$1'"
  ip netns list | grep -qw "$(node_ns "$1")" || die "node $1 does not exist (run: $0 up N RATE DELAY)"
}

cmd_down() {
  require_tools
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${PREFIX}_(hub|node[0-9]+)$" || true); do
    ip netns del "$ns"
  done
  rm -rf /etc/netns/"${PREFIX}"_node*
}

shape() {  # shape NS DEV RATE DELAY: tbf (rate) under an optional netem (delay)
  local ns=$1 dev=$2 rate=$3 delay=$4
  local tbf_args=(tbf rate "$rate" burst "${NETLAB_BURST:-256kb}" latency "${NETLAB_LATENCY:-100ms}")
  if [ "$delay" = "0" ] || [ "$delay" = "0ms" ]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: "${tbf_args[@]}"
  else
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay" 2>/dev/null \
      || die "cannot add a ${delay} delay: this kernel has no sch_netem (use DELAY 0 for rate limiting only)"
    tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: "${tbf_args[@]}"
  fi
}

cmd_up() {
  [ $# -eq 3 ] || die "usage: $0 up N RATE DELAY (e.g. up 2 1gbit 0.2ms)"
  local n=$1 rate=$2 delay=$3 i ns
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 250 ] || die "N must be 2..250, got '$n'"
  require_tools
  ip netns list | grep -qE "^${PREFIX}_(hub|node[0-9]+)( |$)" && die "a netlab with prefix '${PREFIX}' is already up (run: $0 down)"
  trap 'cmd_down' ERR
  ip netns add "$HUB"
  ip -n "$HUB" link set lo up
  ip -n "$HUB" link add br0 type bridge
  ip -n "$HUB" link set br0 up
  for i in $(seq 0 $(( n - 1 ))); do
    ns=$(node_ns "$i")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "${PREFIX}n${i}" netns "$ns" type veth peer name "port${i}" netns "$HUB"
    ip -n "$ns" link set "${PREFIX}n${i}" name eth0
    ip -n "$ns" link set eth0 mtu "$MTU"
    ip -n "$HUB" link set "port${i}" mtu "$MTU" master br0 up
    ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    shape "$ns" eth0 "$rate" "$delay"
  done
  for i in $(seq 0 $(( n - 1 ))); do
    mkdir -p "/etc/netns/$(node_ns "$i")"
    {
      echo "127.0.0.1 localhost"
      for j in $(seq 0 $(( n - 1 ))); do echo "$(node_addr "$j") $(node_host "$j")"; done
    } > "/etc/netns/$(node_ns "$i")/hosts"
  done
  trap - ERR
  echo "netlab: ${n} nodes up (${SUBNET}.1 .. ${SUBNET}.${n}), links ${rate}, delay ${delay}"
}

cmd_run() {
  [ $# -ge 2 ] || die "usage: $0 run NODE CMD..."
  local node=$1; shift
  require_tools
  check_node "$node"
  exec ip netns exec "$(node_ns "$node")" unshare --uts sh -c 'hostname "$0" && exec "$@"' \
    "$(node_host "$node")" env NETLAB_NODE="$node" NETLAB_ADDR="$(node_addr "$node")" \
    NETLAB_MASTER_ADDR="$(node_addr 0)" "$@"
}

cmd_bytes() {
  [ $# -eq 1 ] || die "usage: $0 bytes NODE"
  require_tools
  check_node "$1"
  local ns; ns=$(node_ns "$1")
  echo "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes) $(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  run) shift; cmd_run "$@" ;;
  addr) shift; [ $# -eq 1 ] || die "usage: $0 addr NODE"; node_addr "$1" ;;
  bytes) shift; cmd_bytes "$@" ;;
  down) cmd_down ;;
  *) die "usage: $0 up N RATE DELAY | run NODE CMD... | addr NODE | bytes NODE | down" ;;
esac
