"""Checkpoints under a real mpiexec: round trips at 2-4 ranks, exact resume in a new job,
resume on another world size, and SIGKILL of saving jobs (tests/mpi/checkpoint_suite.py)."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import bagua_mpi as bm
import bagua_mpi.checkpoint as ckpt
from bagua_mpi.checkpoint import rotation
from mpi_harness import (MPI_SUITES, REPO, assert_mpi_ok, library_algorithms, mpiexec_path,
                         run_mpi)

# Every registered algorithm, with hyperparameters that make its per-rank state matter within
# the few steps of the test (a warm-up that ends, a decision that happens, an exchange in
# flight), plus the error-feedback variants. ``ckpt_ef16`` is the suite's own algorithm.
RESUME_SPECS = {
    "gradient_allreduce": ["gradient_allreduce"],
    "qsgd": ["qsgd", "qsgd:error_feedback=True"],
    "bytegrad": ["bytegrad", "bytegrad:error_feedback=True"],
    "onebit_adam": ["onebit_adam:warmup_steps=2"],
    "decentralized": ["decentralized"],
    "low_precision_decentralized": ["low_precision_decentralized"],
    "async": ["async:sync_interval_ms=0,max_staleness=1"],
    "local_sgd": ["local_sgd:period=3"],
    "topk": ["topk:density=0.2"],
    "gtopk": ["gtopk:density=0.2"],
    "powersgd": ["powersgd:rank=2"],
    "lgreco": ["lgreco:warmup_steps=2,period_steps=3"],
    "ckpt_ef16": ["ckpt_ef16"],
}
SUITE_ALGORITHMS = {"ckpt_ef16"}
STATELESS = {"gradient_allreduce", "qsgd", "bytegrad"}  # no per-rank tensors (only the step)
RESUME_CASES = [(spec, ranks) for specs in RESUME_SPECS.values() for spec in specs
                for ranks in (2, 3)]
N, M = 4, 3  # steps before the checkpoint, steps after it


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_round_trip_of_every_kind_of_state(tmp_path, ranks):
    assert_mpi_ok(run_mpi("checkpoint_suite.py", ranks, "roundtrip", str(tmp_path)),
                  f"roundtrip OK on {ranks} ranks")


@pytest.mark.parametrize("ranks", [2, 3])
def test_save_or_load_on_one_rank_raises_on_every_rank(tmp_path, ranks):
    assert_mpi_ok(run_mpi("checkpoint_suite.py", ranks, "on_one_rank", str(tmp_path)),
                  f"on_one_rank OK on {ranks} ranks")


def registered(algorithm: str) -> bool:
    name = algorithm.partition(":")[0]
    return name in bm.algorithms.names() or name in SUITE_ALGORITHMS


def test_every_registered_algorithm_has_a_resume_case():
    missing = library_algorithms() - set(RESUME_SPECS)
    assert not missing, f"algorithms without a resume test: {sorted(missing)}"


def case_values(case):
    return case.values if hasattr(case, "values") else case


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Per world size, one job trains and saves every registered case of that size, and one
    new job resumes them all (two launches per size instead of two per case)."""
    trained, resumed = {}, {}

    def train(ranks: int):
        if ranks not in trained:
            algorithms = [a for a, r in map(case_values, RESUME_CASES)
                          if r == ranks and registered(a)]
            base = str(tmp_path_factory.mktemp(f"trained{ranks}"))
            result = run_mpi("checkpoint_suite.py", ranks, "train", ";".join(algorithms), base,
                             str(N), str(M), timeout=300)
            assert_mpi_ok(result)
            trained[ranks] = base, algorithms, result.output
        return trained[ranks]

    def resume(ranks: int):
        if ranks not in resumed:
            base, algorithms, _ = train(ranks)
            result = run_mpi("checkpoint_suite.py", ranks, "resume", ";".join(algorithms), base,
                             str(M), timeout=300)
            assert_mpi_ok(result)
            resumed[ranks] = result.output
        return resumed[ranks]

    def resume_rebucketed(ranks: int):
        base, algorithms, _ = train(ranks)
        result = run_mpi("checkpoint_suite.py", ranks, "resume", ";".join(algorithms), base,
                         str(M), "0.000001", timeout=300)
        assert_mpi_ok(result)
        return result.output

    return train, resume, resume_rebucketed


def directory_of(base: str, algorithm: str) -> str:
    return os.path.join(base, "".join(c if c.isalnum() else "_" for c in algorithm))


def digests(output: str, kind: str, algorithm: str, ranks: int) -> dict:
    found = {int(r): h for r, h in re.findall(
        rf"{kind} {re.escape(algorithm)} rank (\d+) ([0-9a-f]{{64}})", output)}
    assert sorted(found) == list(range(ranks)), output
    return found


@pytest.mark.parametrize("algorithm, ranks", RESUME_CASES)
def test_resume_in_a_new_job_is_bit_identical(jobs, algorithm, ranks):
    if not registered(algorithm):
        pytest.skip(f"algorithm {algorithm.partition(':')[0]} not registered yet")
    train, resume, _ = jobs
    reference = digests(train(ranks)[2], "REF", algorithm, ranks)
    output = resume(ranks)
    assert digests(output, "RES", algorithm, ranks) == reference, output
    # the checkpoint held per-rank state (decentralized at 2 ranks pairs the two ranks every
    # step, so their models, and with them the checkpoint, stay replicated)
    if algorithm not in STATELESS and (algorithm, ranks) != ("decentralized", 2):
        assert re.search(rf"META {re.escape(algorithm)} (per_rank_algorithm_state=True|"
                         r"\S+ model=per_rank)", output), output


def test_batchnorm_buffers_that_differ_per_rank_load_on_any_world_size(tmp_path):
    """A BatchNorm model trained with gradient_allreduce: its parameters are the same on every
    rank, its running statistics are not (each rank's own batches), so the file holds the model
    per rank. The same number of ranks gets each rank's buffers back; another number loads
    rank 0's copy (parameters and buffers) on every rank. A model whose parameters differ per
    rank is still refused on another number of ranks."""
    base = str(tmp_path)
    saved = run_mpi("checkpoint_suite.py", 3, "batchnorm_save", base, timeout=300)
    assert_mpi_ok(saved)
    by_rank = {int(r): (p, b) for r, p, b in re.findall(
        r"BNSAVE rank (\d+) ([0-9a-f]{64}) ([0-9a-f]{64})", saved.output)}
    assert sorted(by_rank) == [0, 1, 2], saved.output
    assert len({p for p, _ in by_rank.values()}) == 1, "parameters differ per rank"
    assert len({b for _, b in by_rank.values()}) == 3, "the buffers should differ per rank"
    for ranks in (3, 2):
        loaded = run_mpi("checkpoint_suite.py", ranks, "batchnorm_load", base, "3",
                         timeout=300)
        assert_mpi_ok(loaded)
        got = {int(r): (p, b) for r, p, b in re.findall(
            r"BNLOAD rank (\d+) ([0-9a-f]{64}) ([0-9a-f]{64})", loaded.output)}
        assert sorted(got) == list(range(ranks)), loaded.output
        for rank, state in got.items():
            assert state == by_rank[rank if ranks == 3 else 0], (ranks, rank, loaded.output)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_fused_adam_state_of_channels_last_resumes_exactly(tmp_path, ranks):
    """A channels_last CNN with fused Adam and AdamW, resumed by bm.checkpoint (also at
    ZeRO-1) and by Horovod's recipe (rank 0 loads, broadcast_optimizer_state; also with rank
    0's state row-major): the state has its parameters' strides on every rank, and the run
    ends bit for bit where an uninterrupted one does, the same on every rank. Row-major state
    sent torch's CPU kernel, which pairs elements by memory position, elsewhere."""
    assert_mpi_ok(run_mpi("checkpoint_suite.py", ranks, "channels_last", str(tmp_path),
                          "3", "3", timeout=300), f"channels_last OK on {ranks} ranks")


@pytest.mark.parametrize("algorithm, ranks", [("ckpt_ef16", 2), ("topk:density=0.2", 3)])
def test_gan_with_two_optimizers_resumes_bit_identical(tmp_path, algorithm, ranks):
    """Two DistributedOptimizers in one file by name (a GAN; the discriminator's algorithm keeps
    per-rank error feedback): a new job resumes both exactly."""
    base = str(tmp_path)
    trained = run_mpi("checkpoint_suite.py", ranks, "gan_train", algorithm, base, str(N),
                      str(M), timeout=300)
    assert_mpi_ok(trained)
    resumed = run_mpi("checkpoint_suite.py", ranks, "gan_resume", algorithm, base, str(M),
                      timeout=300)
    assert_mpi_ok(resumed)
    assert (digests(resumed.output, "GANRES", algorithm, ranks)
            == digests(trained.output, "GANREF", algorithm, ranks)), resumed.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_optimizers_by_name_refuse_what_does_not_match(tmp_path, ranks):
    """A GAN saved by 2 ranks: loading other optimizer names, or (on 3 ranks) the
    discriminator's per-rank error feedback, raises a named error and changes nothing;
    ``reset_algorithm_state=True`` resumes; ranks naming their optimizers differently cannot
    save."""
    base = str(tmp_path)
    assert_mpi_ok(run_mpi("checkpoint_suite.py", 2, "gan_train", "ckpt_ef16", base, "2", "1",
                          timeout=300))
    misuse = run_mpi("checkpoint_suite.py", ranks, "gan_misuse", "ckpt_ef16", base, "2",
                     timeout=300)
    assert_mpi_ok(misuse)
    assert misuse.output.count("GANMISUSE ckpt_ef16 rank") == ranks, misuse.output


# Algorithms whose trajectory does not depend on how parameters are grouped into buckets, so a
# re-bucketed resume must reach the uninterrupted run's model and optimizer state bit for bit:
# every operation is elementwise (a sum of two ranks' values is the same float whatever the
# bucket; ckpt_ef16's float16 rounding and residual are per element; the model averagers
# average elementwise). The others quantize, sparsify or factorize per bucket (per-bucket
# scales, top-k over the bucket, seeds per bucket index), so another bucketing is another
# (equally valid) trajectory: for them the test checks that the state loads and training goes
# on with finite parameters (the suite asserts that).
REBUCKET_EXACT = {"gradient_allreduce", "ckpt_ef16", "decentralized", "local_sgd:period=3"}


def test_resume_with_other_buckets_loads_every_algorithm(jobs):
    """The per-parameter state of a 2-rank checkpoint saved with one 25 MB bucket loads into
    optimizers with one bucket per parameter, and training goes on; where bucketing cannot
    change the trajectory, it ends where the uninterrupted run does."""
    train, _, resume_rebucketed = jobs
    reference = train(2)[2]
    output = resume_rebucketed(2)
    compared = []
    for specs in RESUME_SPECS.values():
        for spec in specs:
            if registered(spec):
                digests(output, "RES", spec, 2)
                if spec in REBUCKET_EXACT:
                    assert digests(output, "RESMODEL", spec, 2) == \
                        digests(reference, "REFMODEL", spec, 2), f"{spec}:\n{output}"
                    compared.append(spec)
    assert sorted(compared) == sorted(REBUCKET_EXACT)


def test_resume_on_another_world_size(jobs):
    """3-rank checkpoints loaded by 2 ranks: replicated state loads; per-rank
    algorithm state is refused unless reset_algorithm_state=True."""
    train, _, _ = jobs
    shared = directory_of(train(3)[0], "gradient_allreduce")
    per_rank = directory_of(train(3)[0], "ckpt_ef16")
    assert_mpi_ok(run_mpi("checkpoint_suite.py", 2, "world", shared, per_rank), "world OK")


def test_per_rank_algorithm_state_on_other_nodes_is_refused_on_every_rank(tmp_path):
    """Two ranks saved as two nodes, loaded as one node of two: the error feedback is refused
    on both ranks (one rank refusing while the other stepped on was a hang), with a reset
    offered; on the saving layout it loads."""
    assert_mpi_ok(run_mpi("checkpoint_suite.py", 2, "nodes", str(tmp_path)), "nodes OK")


def test_sigkill_in_the_middle_of_per_rank_writes(tmp_path):
    d = str(tmp_path)
    result = run_mpi("checkpoint_suite.py", 3, "crash", d, "rank_write@2", timeout=120)
    assert result.returncode != 0 and "NOT KILLED" not in result.output, result.describe()
    assert "SIGKILL at rank_write on rank 2" in result.output, result.describe()
    assert [rotation.step_of(p) for p in ckpt.list_checkpoints(d)] == [1]
    assert any(".tmp-" in n for n in os.listdir(d))  # the half-written file, never published
    assert ckpt.verify(ckpt.latest(d))["world_size"] == 3  # every rank's group intact


def _wait_until_dead(pids: list[int], timeout: float = 30.0) -> None:
    """Until no process of ``pids`` runs (gone, or a zombie its parent has not reaped)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"rank process {pid} still runs {timeout} s after SIGKILL")


def test_sigkill_at_a_random_moment_of_repeated_saves(tmp_path):
    """Kill the whole job (the ranks, then mpiexec) while it saves in a loop; every published
    checkpoint must verify and ``latest`` must name one of them. The ranks are killed by pid
    and the directory is read only once none runs: mpiexec's proxy starts them in sessions of
    their own, so a signal to mpiexec's group left them saving while the test read (it once
    saw ``latest`` name a file that its listing, a moment earlier, did not have yet)."""
    d = str(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(MPI_SUITES)]))
    proc = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable,
                             str(MPI_SUITES / "checkpoint_suite.py"), "saveloop", d],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines, ranks = [], []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line)
            # "pid <rank> <pid>", possibly run together on one line by the two ranks
            ranks += [int(pid) for pid in re.findall(r"pid \d+ (\d+)", line)]
            if line.startswith("saved 3") or time.monotonic() > deadline:
                break
        time.sleep(random.uniform(0.0, 0.6))  # a save takes ~0.1-0.3 s here
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(ranks) == 2, "".join(lines)
    _wait_until_dead(ranks)
    assert any(line.startswith("saved 3") for line in lines), "".join(lines)
    published = ckpt.list_checkpoints(d)
    assert published and rotation.step_of(published[0]) >= 3
    for path in published:
        assert ckpt.verify(path)["world_size"] == 2
    assert os.path.join(d, rotation.read_latest(d)) in published
    assert len(published) <= 3  # keep=2, plus at most one published before pruning


def parallel_python() -> str | None:
    """A Python whose h5py has parallel HDF5: this one, or BAGUA_MPI_PARALLEL_PYTHON (see
    tests/build_parallel_h5py.sh)."""
    import h5py
    if h5py.get_config().mpi:
        return sys.executable
    return os.environ.get("BAGUA_MPI_PARALLEL_PYTHON")


def test_mpio_scheme_with_parallel_h5py(tmp_path):
    python = parallel_python()
    if python is None:
        pytest.skip("h5py here has no parallel HDF5 (h5py.get_config().mpi is False) and "
                    "BAGUA_MPI_PARALLEL_PYTHON is not set: the mpio write scheme is not tested")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(MPI_SUITES)]))
    suite = str(MPI_SUITES / "checkpoint_suite.py")
    for args in (["roundtrip", str(tmp_path / "rt")],
                 ["train", "ckpt_ef16", str(tmp_path / "tr"), str(N), str(M)]):
        proc = subprocess.run([mpiexec_path(), "-n", "3", python, suite, *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = digests(proc.stdout, "REF", "ckpt_ef16", 3)
    proc = subprocess.run([mpiexec_path(), "-n", "3", python, suite, "resume", "ckpt_ef16",
                           str(tmp_path / "tr"), str(M)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert digests(proc.stdout, "RES", "ckpt_ef16", 3) == reference
    for d in ("rt", "tr/ckpt_ef16"):
        meta = ckpt.verify(ckpt.latest(str(tmp_path / d)))  # serial h5py reads mpio files
        assert meta["write_scheme"] == "mpio" and meta["world_size"] == 3
