"""The examples run as documented (small sizes) and produce what they promise."""
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import bagua_mpi as bm

from mpi_harness import REPO, mpiexec_path


def example_command(script: str, ranks: int, *args: str) -> list[str]:
    return [mpiexec_path(), "-n", str(ranks), "-genv", "OMP_NUM_THREADS", "1",
            sys.executable, str(REPO / "examples" / script), *args]


def run_example(script: str, ranks: int, *args: str, timeout: float = 240):
    proc = subprocess.run(example_command(script, ranks, *args), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
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


# -- the README's main job: one run (4 ranks, smaller sizes), each behaviour its own test --------
@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """(output, plot path) of ``train_mlp.py`` on 4 ranks; its output is a pipe here, so rank 0
    prints plain lines, as in a Slurm log."""
    plot = tmp_path_factory.mktemp("main_job") / "mlp_loss.png"
    out = run_example("train_mlp.py", 4, "--steps", "30", "--hidden", "128", "--batch", "16",
                      "--plot", str(plot))
    return out, plot


def test_readme_main_job_trains_on_4_ranks(main_job):
    """The README's main job, as documented (4 ranks), at a smaller size: the loss falls."""
    out, _ = main_job
    losses = losses_of(out)
    assert "4 ranks, MLP with" in out and len(losses) >= 3, out
    assert losses[-1] < 0.7 * losses[0], out


def test_main_job_prints_progress_lines_from_rank_0_only(main_job):
    out, _ = main_job
    steps = [int(s) for s in re.findall(r"step +(\d+)  loss [0-9.e+-]+ +[0-9.]+ samples/s  "
                                        r"elapsed", out)]
    assert steps == [0, 10, 20, 29], out  # every 10 steps and the last, once (not per rank)
    assert out.count("summary:") == 1, out


def test_main_job_prints_the_summary(main_job):
    out, _ = main_job
    head = re.search(r"^summary: 30 steps in ([0-9.]+) s on 4 ranks; step 0 took ([0-9.]+) s "
                     r"\(set-up, and compiles on a first run\)$", out, re.M)
    assert head and 0 < float(head.group(2)) < float(head.group(1)), out
    rate = re.search(r"^  throughput from step 1 on: ([0-9.]+) samples/s over all ranks "
                     r"\(([0-9.]+) with step 0; 64 samples per step\)$", out, re.M)
    assert rate and float(rate.group(1)) > 0 and float(rate.group(2)) > 0, out
    wait = re.search(r"^  waiting for communication from step 1 on: ([0-9.]+)% of the time "
                     r"\(([0-9.]+) s on rank 0; ([0-9.]+)% with step 0\)$", out, re.M)
    assert wait and 0 <= float(wait.group(1)) <= 100 and 0 <= float(wait.group(3)) <= 100, out
    sent = re.search(r"^  sent per step: [0-9.]+ [KMG]?i?B \(([0-9]+) bytes, rank 0\)$", out,
                     re.M)
    assert sent and int(sent.group(1)) > 0, out  # 4 ranks: every rank sends gradients
    assert re.search(r"^  algorithm: gradient_allreduce, backend: mpi$", out, re.M), out


def test_main_job_writes_the_loss_plot(main_job):
    pytest.importorskip("matplotlib", reason="the plot needs the examples extra (matplotlib)")
    out, plot = main_job
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out
    assert f"loss plot {plot}" in out


def test_main_job_draws_a_bar_when_mpiexec_writes_to_a_terminal(tmp_path):
    """Under mpiexec a rank's output is a pipe; the bar must appear anyway when mpiexec's own
    output is a terminal (``script`` gives it one here)."""
    pytest.importorskip("tqdm", reason="the bar needs the examples extra (tqdm)")
    if shutil.which("script") is None:
        pytest.skip("needs util-linux's script to give mpiexec a terminal")
    cmd = example_command("train_mlp.py", 2, "--steps", "5", "--hidden", "32", "--batch", "8",
                          "--plot", "")
    # bytes, not text: text mode would turn the bar's carriage returns into newlines
    proc = subprocess.run(["script", "-q", "-e", "-c", shlex.join(cmd), "/dev/null"],
                          capture_output=True, timeout=240, cwd=tmp_path)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0, out
    assert "5/5 [" in out and "\r" in out, out  # tqdm's bar, redrawn in place
    assert not re.search(r"step +\d+  loss", out), out  # and no plain lines
    assert "summary: 5 steps" in out, out


def _main_job_module():
    spec = importlib.util.spec_from_file_location("train_mlp", REPO / "examples" / "train_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_rank():
    """bagua_mpi initialised in this process (world size 1), and shut down again after, since
    later test files check the uninitialised state."""
    bm.init(abort_on_exception=False)
    yield
    bm.shutdown()


@pytest.mark.parametrize("name", sorted(bm.algorithms.names()))
def test_main_job_picks_an_optimizer_every_algorithm_accepts(name, one_rank):
    """``--algorithm NAME`` with the default ``--optimizer auto``: the optimizer it builds wraps
    and steps with that algorithm (one rank, in this process; 1-bit Adam refuses SGD with a
    TypeError at wrap time)."""
    job = _main_job_module()
    model = torch.nn.Linear(4, 1)
    optimizer = bm.DistributedOptimizer(
        job.make_optimizer(job.optimizer_kind(name, "auto"), model.parameters(), None),
        named_parameters=model.named_parameters(), algorithm=name)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.close()


def test_main_job_device_is_the_local_ranks_gpu_or_the_cpu(one_rank, monkeypatch):
    """``--device``: the CPU when asked or where torch sees no GPU; a clear exit when CUDA is
    asked for without one; else visible device local rank % count, made current (local rank
    3 of a node whose ranks each see 2 GPUs takes cuda:1)."""
    job = _main_job_module()
    assert job.training_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert job.training_device("auto") == torch.device("cpu")
    with pytest.raises(SystemExit, match="--device cuda: torch .* sees no CUDA GPU on rank 0"):
        job.training_device("cuda")
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(job.bm, "local_rank", lambda: 3)
    for requested in ("auto", "cuda"):
        assert job.training_device(requested) == torch.device("cuda", 1)
    assert current == [1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_main_job_trains_on_the_gpu_by_default(one_rank):
    """On a GPU machine the main job's model and data are on the GPU (one rank, in this
    process: its model, batch and a step through DistributedOptimizer)."""
    job = _main_job_module()
    device = job.training_device("auto")
    assert device.type == "cuda"
    model = job.make_model(16, 32, 2, 1).to(device)
    teacher = job.make_model(16, 8, 1, 1).to(device)
    x, y = job.synthetic_batch(0, 0, 8, 16, teacher)
    assert x.device == y.device == next(model.parameters()).device
    optimizer = bm.DistributedOptimizer(job.make_optimizer("sgd", model.parameters(), None),
                                        named_parameters=model.named_parameters())
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    assert optimizer.backend.startswith("auto: ")
    optimizer.close()


# -- checkpoint_resume.py: the example the sbatch templates run ---------------------------------
RESUME_ARGS = ("--save-every", "10", "--inputs", "32", "--hidden", "64", "--batch", "16")


def digest_of(out: str, steps: int) -> str:
    found = re.search(rf"finished at step {steps}; parameters sha256 ([0-9a-f]{{64}})", out)
    assert found, out
    return found.group(1)


def test_checkpoint_example_resumes_to_the_parameters_of_an_uninterrupted_run(tmp_path):
    """20 steps, then a second run to 40 from ``latest``: the parameters of one 40-step run,
    bit for bit (2 ranks, on the CPU here; ``--device auto`` picks it without a GPU)."""
    ckpt, whole = str(tmp_path / "ckpt"), str(tmp_path / "whole")
    run_example("checkpoint_resume.py", 2, "--checkpoint-dir", ckpt, "--steps", "20",
                *RESUME_ARGS)
    resumed = run_example("checkpoint_resume.py", 2, "--checkpoint-dir", ckpt, "--steps", "40",
                          *RESUME_ARGS)
    assert re.search(r"resumed from \S+ckpt-0000000020\.h5 at step 20 \(saved by 2 ranks\)",
                     resumed), resumed
    uninterrupted = run_example("checkpoint_resume.py", 2, "--checkpoint-dir", whole, "--steps",
                                "40", "--device", "cpu", *RESUME_ARGS)
    assert digest_of(resumed, 40) == digest_of(uninterrupted, 40)


def _checkpoint_module(monkeypatch):
    """``checkpoint_resume.py`` as a module; it imports ``train_mlp`` beside it, as a script
    run from ``examples/`` does."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    spec = importlib.util.spec_from_file_location("checkpoint_resume",
                                                  REPO / "examples" / "checkpoint_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DeviceTensor(torch.Tensor):
    """A stand-in for a CUDA tensor (no GPU here): like one, it refuses ``.numpy()``, and
    ``.cpu()`` gives a host copy."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first.")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_checkpoint_example_digest_copies_device_tensors_to_the_host(monkeypatch):
    """The final digest of a model on a GPU: the same as of its host copy (it called
    ``.numpy()`` on the device tensors, which a CUDA tensor refuses)."""
    job = _checkpoint_module(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    on_device = SimpleNamespace(state_dict=lambda: {
        k: v.detach().as_subclass(DeviceTensor) for k, v in model.state_dict().items()})
    assert job.parameter_digest(on_device) == job.parameter_digest(model)


def test_checkpoint_example_uses_the_main_jobs_device_helper(monkeypatch):
    """One rule for both examples: ``checkpoint_resume`` takes ``train_mlp``'s helper (the
    rank's GPU by local rank % count, made current), and its host batches stay on the CPU."""
    job = _checkpoint_module(monkeypatch)
    assert job.training_device is sys.modules["train_mlp"].training_device
    teacher = job.make_model(8, 4, 1, 1)
    x, y = job.device_batch(3, 1, 5, 8, teacher, torch.device("cpu"))
    assert x.shape == (5, 8) and y.shape == (5, 1) and x.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_checkpoint_example_trains_and_resumes_on_the_gpu(tmp_path):
    """On a GPU (1 rank): the model trains on ``cuda``, a resume loads into it there, and the
    parameters are those of an uninterrupted run on the GPU."""
    ckpt, whole = str(tmp_path / "ckpt"), str(tmp_path / "whole")
    args = ("--device", "cuda", *RESUME_ARGS)
    run_example("checkpoint_resume.py", 1, "--checkpoint-dir", ckpt, "--steps", "20", *args)
    resumed = run_example("checkpoint_resume.py", 1, "--checkpoint-dir", ckpt, "--steps", "40",
                          *args)
    assert "at step 20" in resumed, resumed
    uninterrupted = run_example("checkpoint_resume.py", 1, "--checkpoint-dir", whole,
                                "--steps", "40", *args)
    assert digest_of(resumed, 40) == digest_of(uninterrupted, 40)


def test_main_job_trains_with_onebit_adam():
    """The one registered algorithm that needs Adam, through the example (2 ranks, 120 steps:
    the 100 of Adam's warm-up, then 1-bit momenta): before the example chose the optimizer by
    algorithm it ended in that TypeError."""
    out = run_example("train_mlp.py", 2, "--steps", "120", "--hidden", "64", "--batch", "16",
                      "--algorithm", "onebit_adam", "--plot", "")
    losses = losses_of(out)
    assert "algorithm: onebit_adam" in out and losses[-1] < 0.7 * losses[0], out


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
