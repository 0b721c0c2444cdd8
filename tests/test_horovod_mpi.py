"""Horovod drop-in (issue 15): Horovod's torch API under ``import bagua_mpi as hvd``, at 1-4
ranks under a real mpiexec, each check against a NumPy simulation of every rank's inputs."""
import functools
import re

import pytest

import horovod_suite
from mpi_harness import assert_check_passed, assert_mpi_ok, run_mpi


API_MODES = [mode for mode in horovod_suite.MODES if mode not in horovod_suite.ALONE]


@pytest.fixture(scope="module")
def api_job(tmp_path_factory):
    """The API modes run in one job per world size (each starts every rank's interpreter
    once, which is most of a small job's time here), each reported on its own line."""
    @functools.cache
    def run(nprocs):
        timeline = tmp_path_factory.mktemp(f"timeline{nprocs}") / "timeline.json"
        return run_mpi("horovod_suite.py", nprocs, *API_MODES, timeout=240,
                       env={"HVD_TIMELINE_PATH": str(timeline)})
    return run


@pytest.mark.parametrize("mode", API_MODES)
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_horovod_api(mode, nprocs, api_job):
    assert_check_passed(api_job(nprocs), mode)


@pytest.mark.parametrize("nprocs,per_node", [(1, None), (2, None), (3, "2"), (4, "2")])
def test_process_sets(nprocs, per_node):
    env = {"BAGUA_MPI_RANKS_PER_NODE": per_node} if per_node else {}
    result = run_mpi("horovod_suite.py", nprocs, "process_sets", timeout=120, env=env)
    assert_mpi_ok(result, f"horovod process_sets OK on {nprocs} ranks")


def _elastic_line(result):
    m = re.search(r"elastic result=(\w+) epoch=(\d+) commits=(\d+) failures=(\d) weight=(.*)",
                  result.output)
    assert m, result.describe()
    return m.groups()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_elastic_retries_and_resumes_from_last_commit(nprocs, tmp_path):
    whole = run_mpi("horovod_suite.py", nprocs, "elastic", timeout=120)
    assert_mpi_ok(whole)
    result, epoch, commits, failures, weight = _elastic_line(whole)
    assert (result, epoch, commits, failures) == ("done", "6", "6", "1")
    # the same training stopped after 4 commits, then restarted (as a requeued job would be)
    env = {"HVD_ELASTIC_DIR": str(tmp_path / "ckpt")}
    first = run_mpi("horovod_suite.py", nprocs, "elastic", timeout=120,
                    env={**env, "HVD_ELASTIC_STOP": "4"})
    assert_mpi_ok(first)
    assert _elastic_line(first)[:3] == ("stopped", "4", "4")
    second = run_mpi("horovod_suite.py", nprocs, "elastic", timeout=120, env=env)
    assert_mpi_ok(second)
    r2, e2, c2, f2, w2 = _elastic_line(second)
    assert (r2, e2, c2, f2) == ("done", "6", "6", "0")  # resumed at epoch 4: no failure again
    assert w2 == weight  # exactly the uninterrupted run's weights
