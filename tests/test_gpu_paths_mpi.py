"""The GPU code paths of the primitives, checked without a GPU (Numba's CUDA simulator).

Each suite runs a primitive's device path (Numba device arrays, the CUDA kernels, MPI on
device buffers or payloads staged through the pinned pool) and its host path on the same data
and requires the same bytes; staged runs also check the staging counter (payload bytes only,
no dense device->host copy) and that the pinned buffers are reused. The real-GPU run of all
this is ``tests/gpu/run.sh``.
"""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi

# the simulator, with its race check (numba_kernels._simulator_races)
SIM = {"NUMBA_ENABLE_CUDASIM": "1", "NUMBA_KERNELS_RACECHECK": "1",
       "PYTHONWARNINGS": "ignore::RuntimeWarning"}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_clps_device_path_matches_host(nprocs):
    assert_mpi_ok(run_mpi("gpu_device_suite.py", nprocs, "clps", env=SIM, timeout=400),
                  f"gpu device suite OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_sparse_and_decentralized_device_paths_match_host(nprocs):
    """Top-k's allgather (with the selection's steady state: no scratch allocated after the
    first step), gTop-k's tree staged through the pool, and D_FP_S/D_LP_S's peer exchanges."""
    assert_mpi_ok(run_mpi("gpu_device_suite.py", nprocs, "topk", "gtopk", "decentralized",
                          env=SIM, timeout=400),
                  f"gpu device suite OK on {nprocs} ranks")
