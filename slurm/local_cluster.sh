#!/usr/bin/env bash
# A real single-node Slurm on this machine, for tests and for trying the job templates.
#
#   slurm/local_cluster.sh start    # installs slurm-wlm + munge if missing (root, Debian), starts
#                                   # munged, slurmctld and slurmd on localhost, waits until idle;
#                                   # first removes this user's unused MPICH segments from /dev/shm
#                                   # (slurm/clear_stale_shm.sh)
#   slurm/local_cluster.sh status
#   slurm/local_cluster.sh stop
#   export SLURM_CONF=${BAGUA_MPI_SLURM_DIR:-/tmp/bagua_mpi_slurm}/slurm.conf   # for srun/sbatch
#
# The node advertises BAGUA_MPI_SLURM_CPUS CPUs (default 8) whatever the hardware has, so 4-task
# jobs fit on a 2-core machine (config_overrides); no cgroups (containers rarely allow them).
# BAGUA_MPI_SLURMCTLD_PORT / BAGUA_MPI_SLURMD_PORT (default 16817 / 16818) and
# BAGUA_MPI_SLURM_DIR let a second cluster run beside the first (tests/test_slurm_harness.py).
set -euo pipefail

DIR=${BAGUA_MPI_SLURM_DIR:-/tmp/bagua_mpi_slurm}
CPUS=${BAGUA_MPI_SLURM_CPUS:-8}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)

install_packages() {
    if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v srun >/dev/null; then
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "slurm-wlm and munge are missing and installing them needs root" >&2
        exit 3
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_config() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat > "$CONF" <<CONF
ClusterName=bagua_local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${BAGUA_MPI_SLURMCTLD_PORT:-16817}
SlurmdPort=${BAGUA_MPI_SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=pmi2
ReturnToService=2
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillOnBadExit=1
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

start() {
    install_packages
    write_config
    # A fresh cluster (an empty state folder) numbers its jobs from 1 again, and MPICH names its
    # /dev/shm segments after the job and step ids: a segment left by a killed step of an
    # earlier cluster's job of the same id would fail this one's MPI_Init.
    bash "$(dirname "${BASH_SOURCE[0]}")/clear_stale_shm.sh" >/dev/null || true
    if ! pgrep -x munged >/dev/null; then
        [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
        chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- munged --force 2>/dev/null || munged --force
    fi
    pgrep -f "slurmctld -f $CONF" >/dev/null || slurmctld -f "$CONF"
    pgrep -f "slurmd -f $CONF" >/dev/null || slurmd -f "$CONF"
    export SLURM_CONF=$CONF
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
            echo "slurm ready: export SLURM_CONF=$CONF"
            return 0
        fi
        state=$(sinfo -h -o %T 2>/dev/null || true)
        case "$state" in
            down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    echo "slurm did not come up; logs in $DIR/log" >&2
    tail -n 20 "$DIR"/log/*.log >&2 || true
    exit 1
}

stop() {
    pkill -f "slurmd -f $CONF" 2>/dev/null || true
    pkill -f "slurmctld -f $CONF" 2>/dev/null || true
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF=$CONF sinfo ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
