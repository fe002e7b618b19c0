#!/usr/bin/env bash
# Take down what .ci/multinode_up.sh started: jobs, every process on the nodes, the daemons, the namespaces and the
# /etc/hosts lines (munged only if multinode_up started it).
STATE=${1:-${SLIME_HYDRA_MULTINODE_STATE:-/tmp/slime_hydra_multinode}}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/multinode_net.sh"
if [ -x "$STATE/bin/on_node" ] && [ -e /run/netns/mn_mnode1 ]; then
  timeout 10 "$STATE/bin/on_node" mnode1 scancel --user="$(id -un)" 2>/dev/null || true
fi
for host in "${MN_HOSTS[@]}"; do   # whatever still runs on a node (daemons, job steps, Ray) goes with it
  [ -e "/run/netns/mn_$host" ] || continue
  pids=$(ip netns pids "mn_$host" 2>/dev/null)
  [ -n "$pids" ] && kill $pids 2>/dev/null
done
sleep 1
for host in "${MN_HOSTS[@]}"; do
  [ -e "/run/netns/mn_$host" ] || continue
  pids=$(ip netns pids "mn_$host" 2>/dev/null)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  ip netns del "mn_$host"
done
[ -e "/run/netns/$MN_SWITCH" ] && ip netns del "$MN_SWITCH"
for k in "${!MN_HOSTS[@]}"; do
  addr=${MN_FABRIC[$k]:-${MN_SITE[$k]}}
  sed -i "/^$addr ${MN_HOSTS[$k]}\$/d" /etc/hosts
done
rm -f "$STATE"/slurm*.pid
if [ -f "$STATE/munged.pid" ]; then
  pid=$(cat "$STATE/munged.pid"); kill "$pid" 2>/dev/null; rm -f "$STATE/munged.pid"
fi
exit 0
