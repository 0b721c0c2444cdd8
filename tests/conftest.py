import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent / "mpi"))  # suites whose check lists tests import

import mpi_harness  # noqa: E402  (found through the path above)


@pytest.fixture(scope="session", autouse=True)
def hang_reports_in_pytest_temp(tmp_path_factory):
    """Jobs the tests abort on purpose leave hang reports. They go to this session's pytest temp
    dir, which pytest keeps for its last few sessions (readable after a failure) and then
    removes, rather than piling up in /tmp or /dev/shm."""
    mpi_harness.HANG_REPORTS_DIR = str(tmp_path_factory.mktemp("hang_reports"))


def pytest_sessionfinish(session, exitstatus):
    """The local Slurm that the session's Slurm tests started stops with it (one that was
    running before stays up)."""
    harness = sys.modules.get("slurm_harness")
    if harness is not None:
        harness.stop_local_slurm_if_started()
