# Shared by .ci/slurm_up.sh (one node on loopback) and .ci/multinode_up.sh (two nodes in network namespaces):
# the Debian packages, munge, the slurm.conf settings both share, the sacct stand-in and env.sh. Sourced, with
# STATE set to the cluster's state dir.

slurm_install() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  fi
}

slurm_munge() {  # one daemon per machine; reuse a running one
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
    install -d -o munge -g munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$STATE/munged.pid"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  fi
}

slurm_conf_common() {  # the slurm.conf lines both clusters share
  cat <<EOF
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
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
EOF
}

slurm_client_files() {  # bin/sacct and env.sh
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
}
