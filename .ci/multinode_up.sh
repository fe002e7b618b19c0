#!/usr/bin/env bash
# Stand up a two-node SLURM cluster on this one machine for tests/multinode (run as root):
#
#   .ci/multinode_up.sh [STATE_DIR]      default /tmp/slime_hydra_multinode; prints the state dir
#   .ci/multinode_down.sh [STATE_DIR]    stops the daemons and every process on the nodes, removes the namespaces
#
# Each "host" is a Linux network namespace plus its own UTS namespace (host name), wired to bridges that live in a
# fourth namespace, so nothing is added to this machine's own network (names and addresses: .ci/multinode_net.sh):
#
#   host    fabric      site network
#   mnode1  10.77.0.1   10.78.0.1    slurmctld + slurmd; the login node (jobs are submitted from here)
#   mnode2  10.77.0.2   10.78.0.2    slurmd
#   mout    -           10.78.0.9    no daemon: an outsider that reaches the nodes' site addresses only
#
# Daemons and commands enter a node with nsenter --net plus unshare --uts, not `ip netns exec`: that one also
# remounts /sys for the namespace, which hides /sys/fs/cgroup from slurmd ("Unable to initialize cgroup plugin").
# The filesystem is shared by all of them, as a cluster's shared storage is. munge is this machine's one daemon
# (its socket is a file, so every namespace reaches it). `STATE_DIR/bin/on_node NODE CMD...` runs a command on a
# node (its network and host name); `source STATE_DIR/env.sh` points SLURM clients at this cluster, but they only
# reach slurmctld from a node: run them through on_node.
set -euo pipefail
STATE=${1:-${SLIME_HYDRA_MULTINODE_STATE:-/tmp/slime_hydra_multinode}}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/slurm_lib.sh"
source "$HERE/multinode_net.sh"

slurm_install
"$HERE/multinode_down.sh" "$STATE" >/dev/null 2>&1 || true
munged_pid=$(cat "$STATE/munged.pid" 2>/dev/null || true)
rm -rf "$STATE"
mkdir -p "$STATE"/{ctld,log,bin,spool_mnode1,spool_mnode2}
[ -n "$munged_pid" ] && kill -0 "$munged_pid" 2>/dev/null && echo "$munged_pid" > "$STATE/munged.pid"
chmod 755 "$STATE"
slurm_munge

# the networks: two bridges in their own namespace, one veth per host and network
ip netns add "$MN_SWITCH"
for br in fabric site; do
  ip -n "$MN_SWITCH" link add "$br" type bridge
  ip -n "$MN_SWITCH" link set "$br" up
done
attach() {  # attach HOST_INDEX BRIDGE IFNAME ADDRESS
  local k=$1 br=$2 ifname=$3 addr=$4 ns=mn_${MN_HOSTS[$1]}
  ip link add "mn$br$k" type veth peer name "$ifname" netns "$ns"
  ip link set "mn$br$k" netns "$MN_SWITCH"
  ip -n "$MN_SWITCH" link set "mn$br$k" master "$br" up
  ip -n "$ns" addr add "$addr/24" dev "$ifname"
  ip -n "$ns" link set "$ifname" up
}
for k in "${!MN_HOSTS[@]}"; do
  host=${MN_HOSTS[$k]}
  ip netns add "mn_$host"
  ip -n "mn_$host" link set lo up
  [ -n "${MN_FABRIC[$k]}" ] && attach "$k" fabric eth0 "${MN_FABRIC[$k]}"
  attach "$k" site eth1 "${MN_SITE[$k]}"
  addr=${MN_FABRIC[$k]:-${MN_SITE[$k]}}
  grep -q "^$addr $host\$" /etc/hosts || echo "$addr $host" >> /etc/hosts
done

cat > "$STATE/slurm.conf" <<CONF
ClusterName=mn
SlurmctldHost=mnode1(10.77.0.1)
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool_%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd_%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd_%n.log
CONF
CPUS=$(env -u OMP_NUM_THREADS nproc)
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.4)}' /proc/meminfo)  # the two nodes share this machine's memory
for k in 0 1; do
  echo "NodeName=${MN_HOSTS[$k]} NodeAddr=${MN_FABRIC[$k]} CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN" >> "$STATE/slurm.conf"
done
echo "PartitionName=mn Nodes=mnode1,mnode2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$STATE/slurm.conf"
slurm_conf_common >> "$STATE/slurm.conf"
slurm_client_files

cat > "$STATE/bin/on_node" <<SH
#!/usr/bin/env bash
# on_node NODE CMD...: run CMD on NODE (mnode1, mnode2, mout): its network namespace and host name, this cluster's SLURM_CONF.
node=\$1; shift
export SLURM_CONF=$STATE/slurm.conf PATH=$STATE/bin:\$PATH
exec nsenter --net=/run/netns/mn_\$node unshare --uts sh -c 'hostname "\$0"; exec "\$@"' "\$node" "\$@"
SH
chmod +x "$STATE/bin/on_node"

export SLURM_CONF="$STATE/slurm.conf"
"$STATE/bin/on_node" mnode1 /usr/sbin/slurmctld -i -f "$SLURM_CONF"
for host in mnode1 mnode2; do
  "$STATE/bin/on_node" "$host" /usr/sbin/slurmd -N "$host" -f "$SLURM_CONF"
done
for _ in $(seq 120); do
  states=$("$STATE/bin/on_node" mnode1 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
  [ "$states" = "idle " ] && { echo "$STATE"; exit 0; }
  sleep 0.25
done
echo "multinode_up: nodes did not become idle (states: ${states:-none}); logs in $STATE/log" >&2
exit 1
