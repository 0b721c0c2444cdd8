"""Top-k and gTop-k under a real mpiexec, including world sizes that are not powers of two."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_sparse_allreduces_against_simulation_and_training(nprocs):
    assert_mpi_ok(run_mpi("sparse_suite.py", nprocs, timeout=300),
                  f"sparse suite OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs", [2, 3])   # 3: a tree with a missing partner
def test_gtopk_device_path_in_cuda_simulator(nprocs):
    """The device-resident gTop-k (kernels on device arrays, MPI on device buffers) gives the
    host path's bytes; Numba's CUDA simulator stands in for the GPU, as for the kernels."""
    assert_mpi_ok(run_mpi("sparse_device_suite.py", nprocs, env={"NUMBA_ENABLE_CUDASIM": "1"},
                          timeout=300), f"sparse device suite OK on {nprocs} ranks")
