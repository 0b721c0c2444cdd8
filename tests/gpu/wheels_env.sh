# Installs the carried mpi4py and MPICH wheels (.whl/, tests/gpu/fetch_wheels.sh) outside the
# image's environment and points this shell at them. Sourced from the repository root by run.sh,
# and handy in a device command of its own; uses budget.sh's note, or a plain one.
declare -F note > /dev/null || note() { echo "[gpu] $*"; }
if compgen -G ".whl/*.whl" > /dev/null; then
    note "installing the carried wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/mpi4py-*.whl || return 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --ignore-installed --prefix /tmp/mpich .whl/mpich-*.whl || return 3
    export PYTHONPATH=/tmp/site PATH=/tmp/mpich/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # mpi4py's wheel looks for a libmpi on its own and may find the image's Open MPI first
    export MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12
fi
