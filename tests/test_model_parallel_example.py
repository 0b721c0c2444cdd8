"""examples/model_parallel_downpour.py runs as documented (briefly) and learns."""
import os
import re
import sys

import pytest

from mpi_harness import REPO, assert_mpi_ok, mpiexec_path, run_job


def run_example(ranks: int, *args: str):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                          if p]))
    cmd = [mpiexec_path(), "-n", str(ranks), sys.executable,
           str(REPO / "examples" / "model_parallel_downpour.py"), *args]
    result = run_job(cmd, env, timeout=180)
    assert_mpi_ok(result, "held-out accuracy")
    return result.output


@pytest.mark.parametrize("cut", [[], ["--by-layers"]])
def test_model_parallel_example_learns_and_shows_the_layout(cut):
    out = run_example(5, "--partitions", "2", "--servers", "1", "--steps", "60",
                      "--warm-start", "5", *cut)
    assert "replica 1: [p0 rank 2]  [p1 rank 3]" in out, out
    assert re.search(r"shard 0: \d+ updates from partitions \[0, 1, 2, 3\]", out), out
    acc = float(re.search(r"held-out accuracy ([0-9.]+)", out).group(1))
    assert acc > 0.5, out  # chance is 0.25
