#!/usr/bin/env bash
# Build an isolated Python environment with h5py on *parallel* HDF5, to exercise the checkpoint
# writer's `mpio` scheme on a machine whose h5py is serial (the PyPI wheel). Nothing is
# installed system-wide: Debian's MPICH and parallel-HDF5 packages are unpacked into $DIR.
#
#   tests/build_parallel_h5py.sh [/tmp/phdf5]          # ~10-20 min of compiling on 2 cores
#   BAGUA_MPI_PARALLEL_PYTHON=/tmp/phdf5/python python -m pytest tests/test_checkpoint_mpi.py -k mpio
#
# $DIR/python is a wrapper that sets LD_LIBRARY_PATH for that environment only.
#
# Debian bookworm, amd64: HDF5 1.10.8 with MPICH 4.0.2; the mpich wheel's mpiexec launches it.
set -euo pipefail
DIR=${1:-/tmp/phdf5}
R=$DIR/root
L=$R/usr/lib/x86_64-linux-gnu
mkdir -p "$DIR/debs" "$R" "$DIR/lib"
cd "$DIR/debs"
apt-get update -qq
apt-get download libhdf5-mpich-103-1 libhdf5-mpich-hl-100 libhdf5-mpich-dev libmpich12 \
    libmpich-dev libhwloc15 libucx0 libsz2 libaec0 libnuma1 libibverbs1 librdmacm1 libfabric1 \
    libpsm2-2 libpsm-infinipath1
for deb in *.deb; do dpkg -x "$deb" "$R"; done
ln -sf "$L/libhdf5_mpich.so.103" "$DIR/lib/libhdf5.so"
ln -sf "$(readlink -f "$L/libhdf5_mpich_hl.so")" "$DIR/lib/libhdf5_hl.so"
ln -sf "$L/libmpich.so.12" "$DIR/lib/libmpich.so"
cat > "$DIR/mpicc" <<WRAP
#!/bin/bash
exec gcc -I$R/usr/include/x86_64-linux-gnu/mpich "\$@" -L$DIR/lib -L$L -lmpich \
    -Wl,-rpath,$DIR/lib -Wl,-rpath,$L
WRAP
chmod +x "$DIR/mpicc"
cd "$DIR"
python -m venv --system-site-packages venv  # torch and numpy come from the system Python
./venv/bin/pip install -q cython pkgconfig wheel "setuptools>=77"
export LD_LIBRARY_PATH=$DIR/lib:$L
MPICC=$DIR/mpicc ./venv/bin/pip install --ignore-installed --no-binary mpi4py --no-cache-dir \
    --no-build-isolation mpi4py
HDF5_MPI=ON HDF5_INCLUDEDIR=$R/usr/include/hdf5/mpich HDF5_LIBDIR=$DIR/lib HDF5_VERSION=1.10.8 \
    CC=$DIR/mpicc ./venv/bin/pip install --ignore-installed --no-binary h5py --no-cache-dir \
    --no-build-isolation --no-deps h5py
cat > "$DIR/python" <<WRAP
#!/bin/bash
export LD_LIBRARY_PATH=$DIR/lib:$L\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec $DIR/venv/bin/python "\$@"
WRAP
chmod +x "$DIR/python"
"$DIR/python" -c "import h5py; assert h5py.get_config().mpi; print('parallel h5py', h5py.version.hdf5_version)"
