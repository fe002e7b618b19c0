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

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
if [ -f "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
  "$HERE/slurm_down.sh" "$STATE"
fi
munged_pid=$(cat "$STATE/munged.pid" 2>/dev/null || true)   # a munged this script started earlier stays ours
rm -rf "$STATE"
mkdir -p "$STATE"/{ctld,spool,log,bin}
[ -n "$munged_pid" ] && kill -0 "$munged_pid" 2>/dev/null && echo "$munged_pid" > "$STATE/munged.pid"
chmod 755 "$STATE"

# munge: one daemon per machine; reuse a running one.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
  install -d -o munge -g munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$STATE/munged.pid"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

HOST=$(hostname -s)
if [ "$(getent hosts "$HOST" | awk '{print $1; exit}')" != 127.0.0.1 ]; then
  echo "127.0.0.1 $HOST" >> /etc/hosts   # slurmd must find its own name on loopback
fi
CPUS=$(env -u OMP_NUM_THREADS nproc)  # GNU nproc honours OMP_NUM_THREADS, which .ci/run sets to 1
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)  # more than slurmd -C reports drains the node
cat > "$STATE/slurm.conf" <<EOF
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=5
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

cat > "$STATE/bin/sacct" <<'EOF'
#!/usr/bin/env bash
# sacct stand-in (no accounting database here), answered from squeue, which lists ended jobs for MinJobAge.
# Understands what submitit and slime_hydra.status ask: -j/--jobs IDS, -o/--format FIELDS (JobID, State,
# NodeList, ExitCode, Reason), -n/--noheader; output is always --parsable2 ('|'-separated).
ids=() fields=JobID,State,NodeList,ExitCode,Reason header=1
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) IFS=, read -ra more <<< "$2"; ids+=("${more[@]}"); shift 2 ;;
    --jobs=*) IFS=, read -ra more <<< "${1#--jobs=}"; ids+=("${more[@]}"); shift ;;
    -o|--format) fields=$2; shift 2 ;;
    --format=*) fields=${1#--format=}; shift ;;
    -n|--noheader) header=0; shift ;;
    *) shift ;;
  esac
done
IFS=, read -ra names <<< "$fields"
[ $header = 1 ] && (IFS='|'; echo "${names[*]}")
[ ${#ids[@]} -eq 0 ] && exit 0
squeue -h -t all -j "$(IFS=,; echo "${ids[*]}")" -o '%i|%T|%N|%r' 2>/dev/null | while IFS='|' read -r id state nodes reason; do
  code=$(scontrol -o show job "$id" 2>/dev/null | grep -o ' ExitCode=[0-9:]*' | head -1 | cut -d= -f2)
  row=()
  for name in "${names[@]}"; do
    case "${name,,}" in
      jobid) row+=("$id") ;; state) row+=("$state") ;; nodelist) row+=("$nodes") ;;
      exitcode) row+=("${code:-0:0}") ;; reason) row+=("$reason") ;; *) row+=("") ;;
    esac
  done
  (IFS='|'; echo "${row[*]}")
done
exit 0
EOF
chmod +x "$STATE/bin/sacct"
cat > "$STATE/env.sh" <<EOF
export SLURM_CONF=$STATE/slurm.conf
export PATH=$STATE/bin:\$PATH
EOF

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
