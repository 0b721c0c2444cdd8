"""Top-k and gTop-k under a real mpiexec, including world sizes that are not powers of two
(see tests/mpi/sparse_suite.py); each check is its own test."""
import pytest

from mpi_harness import assert_check_passed, suite_job

import sparse_device_suite
import sparse_suite

suite_run = suite_job("sparse_suite.py")


@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
@pytest.mark.parametrize("check", list(sparse_suite.suite_checks()))
def test_sparse_allreduces(check, nprocs):
    if check == "training" and nprocs > sparse_suite.TRAINING_MAX_RANKS:
        pytest.skip(f"training is a loss bound, checked at 2-{sparse_suite.TRAINING_MAX_RANKS} "
                    f"ranks; at {nprocs} on 2 cores it took most of the suite's time")
    assert_check_passed(suite_run(nprocs), check)


device_suite_run = suite_job("sparse_device_suite.py", env={"NUMBA_ENABLE_CUDASIM": "1"})


@pytest.mark.parametrize("nprocs", [2, 3])   # 3: a tree with a missing partner
@pytest.mark.parametrize("check", list(sparse_device_suite.CHECKS))
def test_gtopk_device_path_in_cuda_simulator(check, nprocs):
    """The device-resident gTop-k (kernels on device arrays, MPI on device buffers) gives the
    host path's bytes; Numba's CUDA simulator stands in for the GPU, as for the kernels."""
    assert_check_passed(device_suite_run(nprocs), check)
