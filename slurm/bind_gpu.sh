#!/bin/bash
# Bind this Slurm task to one GPU by its node-local rank, then run the command.
#
#   srun ... slurm/bind_gpu.sh python train.py
#
# With --gpus-per-node=N every task of a node sees all N GPUs in CUDA_VISIBLE_DEVICES; task
# SLURM_LOCALID keeps entry (SLURM_LOCALID mod N), so local rank i drives GPU i and each
# process sees exactly one device (cuda:0). Without GPUs the variable is left alone.
set -eu
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ -n "${SLURM_LOCALID:-}" ]; then
    IFS=, read -ra devices <<< "$CUDA_VISIBLE_DEVICES"
    export CUDA_VISIBLE_DEVICES=${devices[$(( SLURM_LOCALID % ${#devices[@]} ))]}
fi
exec "$@"
