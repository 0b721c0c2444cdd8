"""The algorithm x option table of docs/training.md, cell by cell, under a real mpiexec: every option
works with every algorithm (its effect measured) or is refused at wrap time, by name.

One 4-rank job posing as two nodes (``BAGUA_MPI_RANKS_PER_NODE=2``, so the hierarchical cells
run two-level with two leaders) reports every cell; each is its own test here.
"""
import pytest

import bagua_mpi as bm
from mpi_harness import assert_check_passed, library_algorithms, run_mpi

import options_suite

_RUN = {}


def suite_run():
    if "run" not in _RUN:
        _RUN["run"] = run_mpi("options_suite.py", 4, env={"BAGUA_MPI_RANKS_PER_NODE": "2"},
                              timeout=900)
    return _RUN["run"]


def test_every_registered_algorithm_has_a_row():
    covered = {bm.algorithms.create(a).name for a in options_suite.ALGORITHMS.values()}
    assert library_algorithms() <= covered


@pytest.mark.parametrize("cell", list(options_suite.suite_checks()))
def test_option_works_or_is_refused(cell):
    assert_check_passed(suite_run(), cell)
