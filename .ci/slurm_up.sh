#!/usr/bin/env bash
# Stand up a one-node SLURM (slurmctld + slurmd + munge) on loopback for the tests in tests/slurm.
#
#   .ci/slurm_up.sh [STATE_DIR]      default /tmp/slime_hydra_slurm; prints the state dir
#   .ci/slurm_down.sh [STATE_DIR]    stops every daemon by its pid file
#
# Everything lives under STATE_DIR: slurm.conf, spool/state dirs, logs, pid files, and bin/sacct, a stand-in
# that answers from `squeue -t all` (no accounting database here: with the real sacct failing, submitit would
# see every job as UNKNOWN and wait forever on one that died without a result). Clients find the cluster through
# SLURM_CONF and that bin/ first on PATH: `source STATE_DIR/env.sh` (tests/slurm/conftest.py does it for pytest).
# Installs slurmctld/slurmd/slurm-client/munge from Debian when missing. Facts: docs/slurm.md.
set -euo pipefail
STATE=${1:-${SLIME_HYDRA_SLURM_STATE:-/tmp/slime_hydra_slurm}}
HERE=$(cd "$(dirname "$0")" && pwd)

source "$HERE/slurm_lib.sh"
slurm_install
if [ -f "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
  "$HERE/slurm_down.sh" "$STATE"
fi
munged_pid=$(cat "$STATE/munged.pid" 2>/dev/null || true)   # a munged this script started earlier stays ours
rm -rf "$STATE"
mkdir -p "$STATE"/{ctld,spool,log,bin}
[ -n "$munged_pid" ] && kill -0 "$munged_pid" 2>/dev/null && echo "$munged_pid" > "$STATE/munged.pid"
chmod 755 "$STATE"

slurm_munge

HOST=$(hostname -s)
if [ "$(getent hosts "$HOST" | awk '{print $1; exit}')" != 127.0.0.1 ]; then
  echo "127.0.0.1 $HOST" >> /etc/hosts   # slurmd must find its own name on loopback
fi
CPUS=$(env -u OMP_NUM_THREADS nproc)  # GNU nproc honours OMP_NUM_THREADS, which .ci/run sets to 1
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)  # more than slurmd -C reports drains the node
cat > "$STATE/slurm.conf" <<EOF
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
slurm_conf_common >> "$STATE/slurm.conf"

slurm_client_files

export SLURM_CONF="$STATE/slurm.conf"
/usr/sbin/slurmctld -i -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF"
for _ in $(seq 120); do
  state=$(sinfo -h -o %T 2>/dev/null | head -1 || true)
  [ "$state" = idle ] && { echo "$STATE"; exit 0; }
  sleep 0.25
done
echo "slurm_up: node did not become idle (state: ${state:-none}); logs in $STATE/log" >&2
exit 1
