#!/usr/bin/env bash
# under_mps.sh CMD...: run CMD with NVIDIA's Multi-Process Service (MPS) started for it and
# stopped after it, whatever CMD's exit. Used by run.sh: without MPS, the two ranks of its
# one-GPU check take turns on the GPU in time slices, and every host wait of an exchange can
# wait for the other process's slice, which a rank with a GPU of its own never does; under
# MPS the two processes' kernels share the GPU at once, as separate GPUs would not, but
# without the turns. Exit status: CMD's, or 4 when the daemon does not start.
set -u
command -v nvidia-cuda-mps-control > /dev/null || { echo "nvidia-cuda-mps-control not found"; exit 4; }
MPS_DIR=$(mktemp -d /tmp/mps.XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
stop() { echo quit | nvidia-cuda-mps-control > /dev/null 2>&1; sleep 1; rm -rf "$MPS_DIR"; }
trap stop EXIT
nvidia-cuda-mps-control -d || { echo "the MPS daemon did not start"; exit 4; }
echo "MPS daemon started (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
"$@"
