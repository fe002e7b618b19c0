#!/usr/bin/env bash
# Stop what .ci/slurm_up.sh started, by pid file (slurmd, slurmctld, then munged if slurm_up started it).
STATE=${1:-${SLIME_HYDRA_SLURM_STATE:-/tmp/slime_hydra_slurm}}
export SLURM_CONF="$STATE/slurm.conf"
if [ -f "$SLURM_CONF" ] && command -v scancel >/dev/null; then
  timeout 10 scancel --user="$(id -un)" 2>/dev/null || true   # jobs first: their steps end before slurmd goes
fi
for daemon in slurmd slurmctld munged; do
  pidfile="$STATE/$daemon.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$pidfile"
done
exit 0
