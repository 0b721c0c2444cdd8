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
# Intel MPI (impi-rt, CUDA-capable) is a 129 MB wheel: keep what a run needs (libmpi, the Hydra
# launcher, libfabric and its providers, the tuning and GPU collective files), xz-compressed
if [ ! -f .whl/impi-slim.tar.xz ]; then
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps --only-binary=:all: -d "$tmp" impi-rt==2021.18.1
    python3 -m zipfile -e "$tmp"/impi_rt-*.whl "$tmp/x" >/dev/null
    data=$(echo "$tmp"/x/impi_rt-*.data/data)
    chmod +x "$data"/bin/*  # zipfile drops the mode bits
    tar -C "$data" -cJf "$tmp/impi-slim.tar.xz" bin/mpiexec.hydra bin/hydra_pmi_proxy \
        bin/hydra_bstrap_proxy lib/libmpi.so.12 lib/libfabric.so.1 \
        $(cd "$data" && echo lib/lib*-fi.so) lib/libmpi_shm_heap_proxy.so lib/mpi opt/mpi/etc etc
    mv "$tmp/impi-slim.tar.xz" .whl/ && rm -rf "$tmp"
fi
ls -la .whl
