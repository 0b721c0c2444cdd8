"""The GPU code paths of the primitives, checked without a GPU (Numba's CUDA simulator).

Each suite runs a primitive's device path (Numba device arrays, the CUDA kernels, MPI on
device buffers or payloads staged through the pinned pool) and its host path on the same data
and requires the same bytes; staged runs also check the staging counter (payload bytes only,
no dense device->host copy) and that the pinned buffers are reused. The real-GPU run of all
this is ``tests/gpu/run.sh``.
"""
import functools

import pytest

import gpu_device_suite
from mpi_harness import assert_check_passed, run_mpi

# the simulator, with its race check (numba_kernels._simulator_races)
SIM = {"NUMBA_ENABLE_CUDASIM": "1", "NUMBA_KERNELS_RACECHECK": "1",
       "PYTHONWARNINGS": "ignore::RuntimeWarning"}


@pytest.fixture(scope="module")
def device_suite():
    """Every check of the suite in one job per world size (the simulator's ranks are slow to
    start), each reported on its own line."""
    return functools.cache(lambda nprocs: run_mpi("gpu_device_suite.py", nprocs, env=SIM,
                                                  timeout=600))


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("check", list(gpu_device_suite.CHECKS))
def test_device_path_matches_host(check, nprocs, device_suite):
    """C_LP_S's packed alltoall of several codecs, top-k's allgather (with the selection's
    steady state: no scratch allocated after the first step), gTop-k's tree staged through the
    pool, and D_FP_S/D_LP_S's peer exchanges; each as with a CUDA-aware MPI and staged
    (gTop-k staged only)."""
    assert_check_passed(device_suite(nprocs), check)
