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


def losses_of(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"step +\d+  loss ([0-9.]+)", out)]


def test_readme_main_job_trains_on_4_ranks():
    """The README's main job, as documented (4 ranks), at a smaller size: the loss falls."""
    out = run_example("train_mlp.py", 4, "--steps", "30", "--hidden", "128", "--batch", "16")
    losses = losses_of(out)
    assert "4 ranks, MLP with" in out and len(losses) >= 3, out
    assert losses[-1] < 0.7 * losses[0], out


def test_downpour_example_beats_predicting_zero():
    out = run_example("downpour_sgd.py", 3, "--steps", "60", "--warm-start", "10")
    held_out, base = (float(v) for v in re.search(
        r"held-out loss ([0-9.]+) \(predicting 0: ([0-9.]+)\)", out).groups())
    assert held_out < base, out


def test_sandblaster_example_converges():
    out = run_example("sandblaster_lbfgs.py", 3, "--samples", "2000", "--dim", "20",
                      "--portions", "8", "--max-iter", "40")
    assert re.search(r": f [0-9.]+, \|g\| ([0-9.e+-]+)", out), out
    gnorm = float(re.search(r": f [0-9.]+, \|g\| ([0-9.e+-]+)", out).group(1))
    assert gnorm < 1e-3, out
