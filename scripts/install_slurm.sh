#!/usr/bin/env bash
# A real single-node Slurm on this machine for the Slurm launcher's tests (tests/test_slurm.py):
# Debian's slurmctld + slurmd + munge, one node with this machine's cores and memory, started as
# root. Idempotent: a second run only (re)starts what is not running. `--stop` stops the daemons.
# A failed install or start fails loudly (exit 1) with one line saying what: CI must not skip.
set -uo pipefail

CONF_DIR=/etc/slurm
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOGS=/var/log/slurm

die() { echo "install_slurm: FAILED: $*" >&2; exit 1; }

if [ "${1:-}" = "--stop" ]; then
    for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
        if [ -f "$pidfile" ]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
        fi
    done
    echo "install_slurm: stopped slurmd, slurmctld, munged"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts slurmctld/slurmd/munged)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v munged >/dev/null || ! command -v srun >/dev/null; then
    command -v apt-get >/dev/null || die "no apt-get here: install slurmctld, slurmd, munge yourself"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update"
    apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        slurmctld slurmd slurm-client munge >/dev/null \
        || die "apt-get install slurmctld slurmd slurm-client munge"
fi

# --- munge: a key, then the daemon (as its own user, as the package does) ----------------------
if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key || die "mungekey --create"
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null || die "munge key"
    fi
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n </dev/null >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --force || die "munged did not start"
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.2; done
    munge -n </dev/null | unmunge >/dev/null 2>&1 || die "munge does not answer (munge -n | unmunge)"
fi

# --- slurm.conf: one node of this machine's cores and memory ----------------------------------
HOST=$(hostname -s)
CPUS=$(nproc --all)
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)
mkdir -p "$CONF_DIR" "$STATE" "$SPOOL" "$LOGS"
cat > "$CONF_DIR/slurm.conf" <<CONF
# written by autotune's scripts/install_slurm.sh
ClusterName=autotune
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# a finished job stays visible to scontrol for 10 minutes (no accounting database here)
MinJobAge=600
KillWait=5
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
    slurmctld || die "slurmctld did not start (see $LOGS/slurmctld.log)"
fi
for _ in $(seq 60); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.5; done
scontrol ping 2>/dev/null | grep -q "is UP" || die "slurmctld does not answer (see $LOGS/slurmctld.log)"
if ! pgrep -x slurmd >/dev/null; then
    slurmd || die "slurmd did not start (see $LOGS/slurmd.log)"
fi
scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
if ! timeout 60 srun --time=1 hostname >/dev/null; then
    die "srun hostname did not answer within 60 s (see $LOGS/slurmd.log, $LOGS/slurmctld.log)"
fi
echo "slurm: $(sinfo -h -o '%P %D node(s) %c CPUs %m MB %T') ($(slurmctld -V))"
