#!/usr/bin/env bash
# A single-node SLURM for the tests (and for trying the cluster profile on one
# machine): installs Debian's slurm-wlm + munge, writes a minimal slurm.conf
# (one node "localhost", one partition "local", select/cons_tres, no
# accounting, every daemon bound to 127.0.0.1) and a munge key when missing.
#
# It does NOT start any daemon: tests/cluster.py starts munged, slurmctld and
# slurmd for the test session and stops them at its end.
#
# Idempotent: a second run installs nothing and rewrites only the files it
# wrote itself (marked by the first line below); a slurm.conf written by
# anybody else is left alone.  Needs root and apt-get; otherwise it explains
# and exits 0, so the SLURM tests skip with that reason.
set -euo pipefail

MARK="# written by smallbatch .ci/setup-slurm.sh"
CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}

if [ "$(id -u)" != 0 ]; then
  echo "setup-slurm: not root: skipping (the SLURM tests will be skipped)" >&2
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sbatch >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "setup-slurm: no apt-get: install slurm-wlm and munge by hand" >&2
    exit 0
  fi
  echo "setup-slurm: installing slurm-wlm and munge" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# ---- munge: key readable only by the munge user, run dir owned by munge
install -d -o munge -g munge -m 0700 /etc/munge
install -d -o munge -g munge -m 0711 /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null; then
    mungekey --create --keyfile=/etc/munge/munge.key --force
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

# ---- slurm directories
install -d -m 0755 "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm

# ---- this machine's size (what slurmd -C would report), minus a margin for
# the daemons and the submitting Snakemake
CPUS=$(nproc)
MEM_MB=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)

write_if_ours() {  # write_if_ours FILE  (content on stdin)
  local f=$1 tmp
  tmp=$(mktemp)
  cat >"$tmp"
  if [ -e "$f" ] && ! head -n1 "$f" | grep -qxF "$MARK"; then
    echo "setup-slurm: $f exists and was not written by this script: left as it is" >&2
    rm -f "$tmp"
    return 0
  fi
  install -m 0644 "$tmp" "$f"
  rm -f "$tmp"
}

write_if_ours "$CONF_DIR/slurm.conf" <<EOF
$MARK
# Single-node SLURM on localhost for smallbatch's tests; no accounting database.
ClusterName=smallbatch
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
# bind to 127.0.0.1 only, never to every address of the machine
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# containers and CI machines: no cgroups needed
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# trust this file over the hardware slurmd finds (keeps the node out of DRAIN)
SlurmdParameters=config_overrides
# finished jobs stay visible to squeue/scontrol for an hour: the Snakemake plugin's
# squeue status command needs to see them finish, and tests/test_slurm.py reads every
# job of a smoke study after it ends (on a loaded machine the study takes 16 min and the
# test reads it minutes later: with 300 s its first jobs had aged out)
MinJobAge=3600
KillWait=10
# The daemons run only while the tests do; a client meanwhile retries the controller
# MessageTimeout - 1 times, a second apart, and Snakemake's SLURM plugin runs
# "scontrol show config" at every start of snakemake, a local run too: 9 s with the
# default 10, 2 s with 3 (measured), still 3 s for a round trip on localhost
MessageTimeout=3
# Two stand-in GPUs (see gres.conf), so the profile's gpu requests are
# scheduled as on a GPU cluster; torch still sees no CUDA here and trains on
# the CPU.
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:2 State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

write_if_ours "$CONF_DIR/gres.conf" <<EOF
$MARK
# Slurm drops GPUs without a device file; /dev/null and /dev/zero stand in for
# /dev/nvidia0-1 (TaskPlugin=task/none: no device cgroups are touched).
NodeName=localhost Name=gpu File=/dev/null,/dev/zero
EOF

echo "setup-slurm: $CONF_DIR/slurm.conf ready (node localhost: $CPUS CPUs, $MEM_MB MB, partition local);" \
     "slurm $(slurmctld -V | awk '{print $2}'), munge $(munged -V 2>&1 | awk '{print $1}' | sed 's/munge-//')" >&2
