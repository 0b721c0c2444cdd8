"""The Horovod-style scripts of examples/horovod/ run under mpiexec, unchanged, and learn.

Each script is run as a user would (``mpiexec -n N python examples/horovod/<script>``, small
sizes) and judged by what it prints: the loss falls or the accuracy beats chance (10 classes),
and what must be equal on every rank is (averaged metrics, weights). The elastic script is also
run through the path that replaces Horovod's in-process recovery: a rank dies, the job ends, and
a restarted job on fewer ranks resumes from the last commit.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from mpi_harness import REPO, mpiexec_path, run_job

EXAMPLES = REPO / "examples" / "horovod"


def run_script(script: str, ranks: int, *args: str, timeout: float = 90, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", BAGUA_MPI_STALL_ABORT_S="60")
    # Buffered stdout: each flushed print() is one write, so the ranks' lines do not interleave
    # mid-line in the combined output (unbuffered, print writes the text and the newline apart).
    env.pop("PYTHONUNBUFFERED", None)
    # The elastic script's failure switch keys on this; a test run inside a requeued Slurm job
    # must not inherit it.
    env.pop("SLURM_RESTART_COUNT", None)
    env.pop("BAGUA_MPI_ELASTIC_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(env_extra or {})
    cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, str(EXAMPLES / script), *args]
    return run_job(cmd, env, timeout)


def ok(result):
    assert not result.timed_out and result.returncode == 0, result.describe()
    return result.output


# -- mnist.py: DistributedSampler, LR scaled by size, metrics averaged with hvd.allreduce --------

FINAL = re.compile(r"rank (\d+)/(\d+) final: own test_loss (\S+) accuracy (\S+) \| "
                   r"averaged test_loss (\S+) accuracy ([0-9.e-]+)")


def mnist_finals(out: str, ranks: int) -> dict[int, tuple[str, ...]]:
    finals = {int(m[0]): m[2:] for m in FINAL.findall(out)}
    assert sorted(finals) == list(range(ranks)), out  # one final line per rank
    assert len(FINAL.findall(out)) == ranks, out
    return finals


def check_metric_averaging(finals: dict, out: str) -> None:
    own_loss = [float(f[0]) for f in finals.values()]
    own_acc = [float(f[1]) for f in finals.values()]
    # the averaged numbers are one allreduce result: bit for bit the same text on every rank
    assert len({(f[2], f[3]) for f in finals.values()}) == 1, out
    avg_loss, avg_acc = float(finals[0][2]), float(finals[0][3])
    # ... and they are the mean of what the ranks measured on their own shards (equal sizes,
    # the sampler pads), which differ: otherwise the check would not show any averaging
    assert len(set(own_loss)) > 1, out
    assert avg_loss == pytest.approx(sum(own_loss) / len(own_loss), rel=1e-9), out
    assert avg_acc == pytest.approx(sum(own_acc) / len(own_acc), rel=1e-9), out


def epochs_of(out: str) -> list[tuple[float, float, float]]:
    return [tuple(map(float, m)) for m in re.findall(
        r"epoch \d+ train_loss ([0-9.]+) test_loss ([0-9.]+) accuracy ([0-9.]+)", out)]


@pytest.fixture(scope="module")
def mnist_2_ranks():
    return ok(run_script("mnist.py", 2, "--epochs", "2"))


def test_mnist_learns_on_2_ranks(mnist_2_ranks):
    epochs = epochs_of(mnist_2_ranks)
    assert len(epochs) == 2, mnist_2_ranks  # rank 0 alone prints the epoch lines
    assert epochs[-1][0] < 0.5 * epochs[0][0], mnist_2_ranks  # train loss
    assert epochs[-1][2] > 0.6, mnist_2_ranks  # accuracy; chance is 0.1


def test_mnist_metrics_are_averaged_over_ranks(mnist_2_ranks):
    check_metric_averaging(mnist_finals(mnist_2_ranks, 2), mnist_2_ranks)


def test_mnist_on_3_ranks_with_fp16_allreduce():
    """An odd number of ranks (the test set of 512 does not split evenly: the sampler pads)
    and float16 gradients on the wire."""
    out = ok(run_script("mnist.py", 3, "--epochs", "2", "--fp16-allreduce"))
    epochs = epochs_of(out)
    assert len(epochs) == 2 and epochs[-1][0] < 0.6 * epochs[0][0], out
    assert epochs[-1][2] > 0.5, out
    check_metric_averaging(mnist_finals(out, 3), out)


# -- accumulate_fp16.py: backward_passes_per_step=2 with Compression.fp16 ------------------------

ACC_RANK = re.compile(r"rank (\d+): (\d+) steps (\d+) backward passes weights ([0-9a-f]{16})")


def test_accumulation_with_fp16_learns_and_matches_one_pass(tmp_path):
    torch = pytest.importorskip("torch")
    two = ok(run_script("accumulate_fp16.py", 2, "--epochs", "1", "--passes", "2", "--save",
                        str(tmp_path / "two.pt")))
    ranks = ACC_RANK.findall(two)
    assert sorted(int(r[0]) for r in ranks) == [0, 1], two
    for _, steps, passes, _ in ranks:  # 1024 samples per rank, 32 per step
        assert (int(steps), int(passes)) == (32, 64), two
    # every rank applied the same averaged gradients (each saw other data): equal weights
    assert len({r[3] for r in ranks}) == 1, two
    first, last = map(float, re.search(r"first 4 steps ([0-9.]+), of the last 4 steps "
                                       r"([0-9.]+)", two).groups())
    assert last < 0.6 * first, two

    # The same data in one backward pass per step: the two passes were added up before the
    # exchange, so the models agree but for rounding (relative difference ~1e-6 here; when
    # the first micro-batch's gradient is lost, 0.25 to 0.45).
    ok(run_script("accumulate_fp16.py", 2, "--epochs", "1", "--passes", "1", "--save",
                  str(tmp_path / "one.pt")))

    def flat(name):
        state = torch.load(tmp_path / name)
        return torch.cat([v.flatten() for v in state.values()])

    a, b = flat("two.pt"), flat("one.pt")
    assert ((a - b).norm() / b.norm()).item() < 1e-3


# -- elastic_mnist.py: hvd.elastic.run; a dead rank ends the job, a restart resumes ---------------

START = re.compile(r"rank (\d+)/(\d+) start epoch (\d+) batch (\d+) step (\d+) lr ([0-9.e-]+) "
                   r"weights ([0-9a-f]{16})")
COMMIT = re.compile(r"commit epoch (\d+) batch (\d+) step (\d+) weights ([0-9a-f]{16})")
EPOCH = re.compile(r"epoch (\d+) train_loss ([0-9.]+) accuracy ([0-9.]+) \((\d+) batches\)")
LR, BATCH, SAMPLES = 0.02, 16, 960


def test_a_dead_rank_ends_the_job_and_the_requeued_job_resumes_on_fewer_ranks(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = ("--checkpoint-dir", ckpt, "--epochs", "3", "--batch-size", str(BATCH),
              "--train-samples", str(SAMPLES), "--lr", str(LR), "--commit-every", "4")

    # First attempt, 3 ranks: rank 1 exits abruptly after step 25. MPI cannot go on without
    # it, so mpiexec ends the job: non-zero and well within the timeout (no hang).
    first = run_script("elastic_mnist.py", 3, *common, "--die-at-step", "25", timeout=90)
    assert not first.timed_out and first.returncode != 0, first.describe()
    assert "rank 1: simulated node failure after step 25" in first.output, first.describe()
    starts = START.findall(first.output)
    assert len(starts) == 3 and {s[2:5] for s in starts} == {("0", "0", "0")}, first.output
    commits = COMMIT.findall(first.output)
    # 20 steps per epoch on 3 ranks: commits at 4, 8, ..., 20 (end of epoch 0), 24
    assert [int(c[2]) for c in commits] == [4, 8, 12, 16, 20, 24], first.output
    last_epoch, last_batch, last_step, last_weights = commits[-1]
    assert (last_epoch, last_batch) == ("1", "4"), first.output
    first_epoch = EPOCH.findall(first.output)
    assert len(first_epoch) == 1 and first_epoch[0][3] == "20", first.output

    # The requeued job got 2 nodes: same command without the failure switch, fewer ranks.
    second = run_script("elastic_mnist.py", 2, *common, timeout=90)
    out = ok(second)
    starts = START.findall(out)
    assert sorted(int(s[0]) for s in starts) == [0, 1] and {s[1] for s in starts} == {"2"}, out
    for _, _, epoch, batch, step, lr, weights in starts:
        # resumed exactly at the last commit: counters, and the weights' digest
        assert (epoch, batch, step) == (last_epoch, last_batch, last_step), out
        assert weights == last_weights, out
        # the restored optimizer brought the 3-rank learning rate; the reset callback that
        # the script registered rescaled it to this world's size
        assert float(lr) == pytest.approx(LR * 2), out
    epochs = EPOCH.findall(out)
    assert [e[0] for e in epochs] == ["1", "2"], out  # epoch 0 is not repeated
    # epoch 1 continued where the commit left it: 4 batches of 3 x 16 samples were done, the
    # remaining 768 samples are 24 batches of 2 x 16 (a full epoch on 2 ranks is 30)
    assert [int(e[3]) for e in epochs] == [24, 30], out
    losses = [float(first_epoch[0][1])] + [float(e[1]) for e in epochs]
    assert losses[2] < losses[1] < losses[0] and losses[2] < 0.7 * losses[0], out
    assert float(epochs[-1][2]) > 0.5, out  # accuracy; chance is 0.1
    assert re.search(r"done: 78 steps", out), out  # 24 + 24 + 30


def test_the_failure_switch_is_off_in_a_requeued_slurm_job(tmp_path):
    """``--die-at-step`` acts on the first attempt only: with Slurm's restart count set, the
    same command line trains to the end (what lets the requeued job go on)."""
    out = ok(run_script("elastic_mnist.py", 2, "--epochs", "1", "--train-samples", "320",
                        "--die-at-step", "3", timeout=60,
                        env_extra={"SLURM_RESTART_COUNT": "1"}))
    assert "simulated node failure" not in out and re.search(r"done: 10 steps", out), out
