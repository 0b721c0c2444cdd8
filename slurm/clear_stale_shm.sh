#!/bin/bash
# Remove this user's stale MPICH shared-memory segments from this node's /dev/shm.
#
#   srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
#       --mpi=none slurm/clear_stale_shm.sh          # once per node, before the MPI step
#
# MPICH names a step's node segments /dev/shm/mpich_shm_<id>_<node> and mpich_vci_<id>_<node>,
# <id> derived from the Slurm job and step ids, and unlinks them in MPI_Finalize. A killed step
# (SIGKILL, scontrol requeue, the MPI_Abort of an uncaught exception) leaves them behind. A
# requeued job keeps its job id and numbers its steps from 0 again, so its MPI_Init on the same
# node opens the dead step's segment and fails ("UCX ERROR failed to unpack address", "Invalid
# GenQ flag"); the sbatch templates run this script when SLURM_RESTART_COUNT > 0.
# A segment that a live process maps or holds open (another job of this user on a shared node)
# is kept: a rank of that job still in MPI_Init would otherwise miss it.
set -u
shopt -s nullglob

# Segments some process uses: mapped (/proc/PID/maps) or open (/proc/PID/fd). Another user's
# processes are unreadable, but their segments are not this user's either.
in_use() {
    local pattern='/dev/shm/mpich_(shm|vci)_[^ ]*'
    grep -ohE "$pattern" /proc/[0-9]*/maps 2>/dev/null
    find /proc/[0-9]*/fd -maxdepth 1 -lname '/dev/shm/mpich_*' -printf '%l\n' 2>/dev/null
}

declare -A used=()
while read -r path; do
    used[$path]=1
done < <(in_use)

removed=0 kept=0
for path in /dev/shm/mpich_shm_* /dev/shm/mpich_vci_*; do
    [ -O "$path" ] || continue            # only this user's
    if [ -n "${used[$path]:-}" ]; then
        kept=$((kept + 1))
    elif rm -f -- "$path"; then
        removed=$((removed + 1))
    fi
done
echo "clear_stale_shm.sh on $(hostname -s): removed ${removed} stale MPICH segment(s) of" \
     "$(id -un), kept ${kept} in use"
