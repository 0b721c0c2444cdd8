"""Elastic restores under a real mpiexec at 2 and 3 ranks (see tests/mpi/elastic_suite.py): after
an error every rank sees, ``elastic.run`` restores the last commit and the run ends bit for bit
where the same training that never failed ends, for every registered algorithm, ZeRO, and a GAN
whose second model and optimizer are keyword arguments of ``TorchState``."""
import pytest

from mpi_harness import assert_check_passed, library_algorithms, suite_job

import elastic_suite

suite_run = suite_job("elastic_suite.py", timeout=400)


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("check", list(elastic_suite.suite_checks(sorted(library_algorithms()))))
def test_elastic(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
