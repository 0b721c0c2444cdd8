"""The examples run as documented (small sizes) and produce what they promise."""
import re
import subprocess
import sys

import pytest

from mpi_harness import REPO, mpiexec_path


def run_example(script: str, ranks: int, *args: str, timeout: float = 240):
    env_cmd = [mpiexec_path(), "-n", str(ranks), "-genv", "OMP_NUM_THREADS", "1",
               sys.executable, str(REPO / "examples" / script), *args]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_cnn_example_learns_and_writes_the_loss_plot(tmp_path):
    pytest.importorskip("tqdm", reason="the CNN example needs the examples extra (tqdm)")
    pytest.importorskip("matplotlib", reason="the CNN example needs the examples extra "
                                             "(matplotlib)")
    plot = tmp_path / "loss.png"
    out = run_example("train_cnn.py", 2, "--steps", "60", "--plot", str(plot))
    accuracy = float(re.search(r"accuracy on fresh images ([0-9.]+)", out).group(1))
    assert accuracy > 0.6, out  # 4 classes: chance is 0.25
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "60/60" in out  # the progress bar ran to the end
