"""Adasum (issue 24): ``op=hvd.Adasum`` for the allreduce family and ``DistributedOptimizer``
under a real mpiexec, against an independent NumPy simulation of every rank (each check of
``tests/mpi/adasum_suite.py`` is its own test here). At 3 ranks the math runs on a process
set of 2 ranks and the global set must refuse (Horovod's power-of-two rule)."""
import pytest

from mpi_harness import assert_check_passed, assert_mpi_ok, suite_job

import adasum_suite

suite_run = suite_job("adasum_suite.py")


@pytest.mark.parametrize("check", list(adasum_suite.CHECKS))
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_adasum(nprocs, check):
    assert_check_passed(suite_run(nprocs), check)


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_adasum_suite_exits_cleanly(nprocs):
    assert_mpi_ok(suite_run(nprocs), f"adasum suite OK on {nprocs} ranks")
