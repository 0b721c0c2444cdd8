#!/usr/bin/env bash
# Fetch, on the development machine, the wheels the GPU image lacks (its Python is 3.12 with
# torch, numba, numba-cuda, cupy, mpi4py, h5py and NCCL, but no MPI library or mpiexec): the
# MPICH wheel and the mpi4py release this project is tested with. They land in .whl/ (ignored
# by git through .git/info/exclude) and travel with `carry: [".whl"]` (about 15 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p "$(git rev-parse --git-dir)/info"
grep -qx '/.whl/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null \
    || echo '/.whl/' >> "$(git rev-parse --git-dir)/info/exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl mpi4py==4.1.2 mpich==5.0.2
ls -la .whl
