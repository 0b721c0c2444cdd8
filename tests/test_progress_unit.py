"""``bagua_mpi.progress``: plain lines, the summary's arithmetic, the bar-or-lines choice, silent
ranks, the loss record and plot, and the optimizer's ``wait_seconds`` counter (one process)."""
import io
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch

from bagua_mpi import progress as prog
from bagua_mpi.progress import Progress, Summary


class FakeClock:
    """A clock that advances ``tick`` seconds each time it is read."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class FakeOptimizer:
    """Counts like ``DistributedOptimizer.communication_stats()``: ``per_step`` bytes and
    ``wait`` seconds each step, from a non-zero start (an optimizer used before)."""

    def __init__(self, per_step: int, wait: float, sent_before: int = 5000,
                 waited_before: float = 7.0):
        self.bytes_sent, self.waited = sent_before, waited_before
        self.per_step, self.wait = per_step, wait
        self.algorithm = SimpleNamespace(name="gradient_allreduce")
        self.backend = "mpi"

    def step(self) -> None:
        self.bytes_sent += self.per_step
        self.waited += self.wait

    def communication_stats(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "wait_seconds": self.waited}


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_loop(progress: Progress, losses, optimizer=None) -> Progress:
    with progress:
        for loss in losses:
            if optimizer is not None:
                optimizer.step()
            progress.step(loss)
    return progress


LINE = re.compile(r"step +(\d+)  loss ([0-9.e+-]+) +([0-9.]+) samples/s  elapsed ([0-9.:]+)")


# -- plain lines -----------------------------------------------------------------------------------
def test_plain_lines_come_every_k_steps_and_at_the_last_one():
    out = io.StringIO()
    run_loop(Progress(25, samples_per_step=64, every=10, seconds=None, stream=out, rank=0,
                      clock=FakeClock(0.5)),
             [1.0 / (i + 1) for i in range(25)])
    lines = [LINE.match(line) for line in out.getvalue().splitlines() if line.startswith("step")]
    assert [int(m.group(1)) for m in lines] == [0, 10, 20, 24]
    assert [float(m.group(2)) for m in lines] == pytest.approx([1.0, 1 / 11, 1 / 21, 1 / 25],
                                                               abs=1e-5)


def test_plain_lines_show_samples_per_second_since_the_previous_line():
    out = io.StringIO()
    # one clock read per step, 0.5 s apart, 64 samples a step: 128 samples/s
    run_loop(Progress(21, samples_per_step=64, every=10, seconds=None, stream=out, rank=0,
                      clock=FakeClock(0.5)), [1.0] * 21)
    rates = [float(m.group(3)) for m in map(LINE.match, out.getvalue().splitlines()) if m]
    assert rates == pytest.approx([128.0, 128.0, 128.0])


def test_plain_lines_also_come_when_seconds_pass_without_a_report():
    out = io.StringIO()
    run_loop(Progress(10, samples_per_step=1, every=100, seconds=30.0, stream=out, rank=0,
                      clock=FakeClock(20.0)), [3.0] * 10)
    steps = [int(m.group(1)) for m in map(LINE.match, out.getvalue().splitlines()) if m]
    # step 0 reports; then a line once 30 s passed since the last one (20 s a step)
    assert steps == [0, 2, 4, 6, 8, 9]


def test_reduce_loss_runs_at_report_steps_only_and_its_value_is_shown():
    calls = []

    def mean_over_ranks(t):
        calls.append(float(t))
        return t * 0 + 42.0
    out = io.StringIO()
    run_loop(Progress(12, samples_per_step=1, every=5, seconds=None, reduce_loss=mean_over_ranks,
                      stream=out, rank=0, clock=FakeClock(0.1)), [float(i) for i in range(12)])
    assert calls == [0.0, 5.0, 10.0, 11.0]
    assert {float(m.group(2)) for m in map(LINE.match, out.getvalue().splitlines()) if m} == {42.0}


# -- the summary -----------------------------------------------------------------------------------
def test_summary_arithmetic_with_a_fake_optimizer():
    opt = FakeOptimizer(per_step=1000, wait=0.25)
    # clock: read at enter, once per step, once by the summary: 0.5 s a read
    progress = run_loop(Progress(10, samples_per_step=64, optimizer=opt, seconds=None,
                                 stream=io.StringIO(), rank=0, ranks=4, clock=FakeClock(0.5)),
                        [1.0] * 10, optimizer=opt)
    s = progress.result
    assert s.steps == 10
    assert s.wall_seconds == pytest.approx(5.5)  # 11 reads after the one at enter
    assert s.samples_per_second == pytest.approx(10 * 64 / 5.5)
    # what happened inside the block only: the optimizer's earlier counts are subtracted
    assert s.wait_seconds == pytest.approx(2.5)
    assert s.wait_share == pytest.approx(2.5 / 5.5)
    assert s.bytes_sent == 10_000 and s.bytes_per_step == pytest.approx(1000)
    assert (s.algorithm, s.backend, s.ranks) == ("gradient_allreduce", "mpi", 4)


def test_summary_lines_name_every_figure():
    lines = Summary(steps=50, wall_seconds=4.0, samples_per_step=256, ranks=4, wait_seconds=1.0,
                    bytes_sent=50 * 3 * 1024 * 1024, algorithm="bytegrad",
                    backend="mpi").lines()
    assert lines == [
        "summary: 50 steps in 4.00 s on 4 ranks",
        "  throughput: 3200.0 samples/s over all ranks (256 samples per step)",
        "  waiting for communication: 25.0% of the time (1.00 s on rank 0)",
        "  sent per step: 3.00 MiB (3145728 bytes, rank 0)",
        "  algorithm: bytegrad, backend: mpi"]


class SlowFirstStepClock:
    """Reads 0 at the block's start, then ``first`` at step 0's end, then ``tick`` more at each
    later read (the later steps and the summary)."""

    def __init__(self, first: float, tick: float):
        self.reads, self.first, self.tick = 0, first, tick

    def __call__(self) -> float:
        self.reads += 1
        return 0.0 if self.reads == 1 else self.first + (self.reads - 2) * self.tick


class SlowFirstStepOptimizer(FakeOptimizer):
    """Waits ``first_wait`` seconds in step 0 and ``wait`` in each later step."""

    def __init__(self, first_wait: float, wait: float):
        super().__init__(per_step=100, wait=wait)
        self.first_wait, self.calls = first_wait, 0

    def step(self) -> None:
        super().step()
        if self.calls == 0:
            self.waited += self.first_wait - self.wait
        self.calls += 1


def test_summary_tells_step_0_apart_from_the_later_steps():
    # step 0 takes 12 s, of which 11.9 s waiting (kernels compiling under a first collective);
    # the 9 steps after it 0.5 s each, 0.2 s of it waiting; the summary's read adds 0.5 s
    opt = SlowFirstStepOptimizer(first_wait=11.9, wait=0.2)
    progress = run_loop(Progress(10, samples_per_step=64, optimizer=opt, seconds=None,
                                 stream=io.StringIO(), rank=0, ranks=4,
                                 clock=SlowFirstStepClock(12.0, 0.5)),
                        [1.0] * 10, optimizer=opt)
    s = progress.result
    assert s.wall_seconds == pytest.approx(17.0)
    assert s.first_step_seconds == pytest.approx(12.0)
    assert s.first_step_wait_seconds == pytest.approx(11.9)
    assert s.later_seconds == pytest.approx(5.0)
    assert s.later_samples_per_second == pytest.approx(9 * 64 / 5.0)
    assert s.later_wait_share == pytest.approx(9 * 0.2 / 5.0)
    assert s.samples_per_second == pytest.approx(10 * 64 / 17.0)  # every step, as before
    assert s.wait_share == pytest.approx((11.9 + 9 * 0.2) / 17.0)
    assert s.lines()[:3] == [
        "summary: 10 steps in 17.0 s on 4 ranks; step 0 took 12.0 s (set-up, and compiles on a "
        "first run)",
        "  throughput from step 1 on: 115.2 samples/s over all ranks (37.6 with step 0; 64 "
        "samples per step)",
        "  waiting for communication from step 1 on: 36.0% of the time (1.80 s on rank 0; 80.6% "
        "with step 0)"]


def test_summary_of_a_single_step_has_nothing_to_leave_out():
    opt = FakeOptimizer(per_step=10, wait=0.5)
    progress = run_loop(Progress(1, samples_per_step=8, optimizer=opt, seconds=None,
                                 stream=io.StringIO(), rank=0, clock=FakeClock(1.0)),
                        [1.0], optimizer=opt)
    s = progress.result
    assert s.first_step_seconds == pytest.approx(1.0)
    assert s.later_seconds is None and s.later_samples_per_second is None
    assert s.later_wait_share is None
    assert s.lines()[:3] == ["summary: 1 step in 2.00 s",
                             "  throughput: 4.0 samples/s over all ranks (8 samples per step)",
                             "  waiting for communication: 25.0% of the time (0.50 s on rank 0)"]


def test_summary_leaves_out_what_the_optimizer_does_not_count():
    class Adasumish(FakeOptimizer):
        def communication_stats(self):
            raise NotImplementedError("op=Adasum")
    for optimizer in (None, Adasumish(1, 1.0)):
        progress = run_loop(Progress(3, samples_per_step=8, optimizer=optimizer, rank=0,
                                     stream=io.StringIO(), clock=FakeClock(1.0)), [1.0] * 3)
        text = "\n".join(progress.result.lines())
        assert "waiting" not in text and "sent per step" not in text, text
        assert progress.result.samples_per_second == pytest.approx(3 * 8 / 4.0)


def test_rank_0_prints_the_summary_after_the_lines():
    out = io.StringIO()
    run_loop(Progress(3, samples_per_step=8, optimizer=FakeOptimizer(10, 0.1), seconds=None,
                      stream=out, rank=0, ranks=2, clock=FakeClock(1.0)), [1.0] * 3)
    lines = out.getvalue().splitlines()
    assert lines[-5].startswith("summary: 3 steps in 4.00 s on 2 ranks")
    assert lines[-1] == "  algorithm: gradient_allreduce, backend: mpi"


def test_no_summary_when_the_loop_raises():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress(5, samples_per_step=1, stream=out, rank=0, clock=FakeClock(1.0)) as p:
            p.step(1.0)
            raise RuntimeError("diverged")
    assert "summary" not in out.getvalue()


# -- other ranks -----------------------------------------------------------------------------------
def test_other_ranks_print_nothing_but_still_reduce_the_loss():
    out, calls = TerminalStream(), []
    run_loop(Progress(11, samples_per_step=1, optimizer=FakeOptimizer(1, 0.1), every=5,
                      reduce_loss=lambda t: calls.append(1) or t, mode="auto", stream=out,
                      rank=1, clock=FakeClock(1.0)), [1.0] * 11)
    assert out.getvalue() == ""
    assert len(calls) == 3  # steps 0, 5, 10: the collective must run on every rank


# -- bar or lines ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, rank, on_terminal, have_tqdm, expected", [
    ("auto", 0, True, True, prog.BAR),
    ("auto", 0, False, True, prog.PLAIN),     # a log file, a pipe
    ("auto", 0, True, False, prog.PLAIN),     # tqdm not installed
    ("plain", 0, True, True, prog.PLAIN),
    ("bar", 0, False, True, prog.BAR),
    ("bar", 0, True, False, prog.PLAIN),
    ("auto", 1, True, True, prog.SILENT),
    ("plain", 3, False, True, prog.SILENT),
])
def test_choose_display(mode, rank, on_terminal, have_tqdm, expected):
    assert prog.choose_display(mode, rank=rank, on_terminal=on_terminal,
                               have_tqdm=have_tqdm) == expected


def test_choose_display_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="'auto', 'bar' or 'plain'"):
        prog.choose_display("fancy", rank=0, on_terminal=True, have_tqdm=True)


def test_a_terminal_stream_gets_a_bar_and_a_string_buffer_plain_lines():
    pytest.importorskip("tqdm")
    tty = TerminalStream()
    run_loop(Progress(30, samples_per_step=4, stream=tty, rank=0), [0.5] * 30)
    assert "30/30" in tty.getvalue() and "\r" in tty.getvalue()  # a bar redrawn in place
    assert "loss 0.50000" in tty.getvalue()
    assert "summary: 30 steps" in tty.getvalue()
    log = io.StringIO()
    run_loop(Progress(30, samples_per_step=4, stream=log, rank=0), [0.5] * 30)
    assert "\r" not in log.getvalue() and LINE.match(log.getvalue())


def test_without_tqdm_a_terminal_gets_plain_lines(monkeypatch):
    monkeypatch.setattr(prog, "load_tqdm", lambda: None)
    tty = TerminalStream()
    run_loop(Progress(3, samples_per_step=4, stream=tty, rank=0), [0.5] * 3)
    assert "\r" not in tty.getvalue() and LINE.match(tty.getvalue())


def test_output_is_terminal_asks_the_stream():
    assert prog.output_is_terminal(TerminalStream())
    assert not prog.output_is_terminal(io.StringIO())


def fake_proc(root, processes):
    """A /proc of ``(pid, parent, name, stdout target)`` entries."""
    for pid, parent, name, target in processes:
        d = root / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "comm").write_text(name + "\n")
        (d / "stat").write_text(f"{pid} ({name}) S {parent} 1 1 0")
        (d / "fd" / "1").symlink_to(target)
    return root


def test_a_rank_under_mpiexec_in_a_terminal_sees_the_terminal(tmp_path):
    proc = fake_proc(tmp_path, [(30, 20, "python", "pipe:[7]"),
                                (20, 10, "hydra_pmi_proxy", "pipe:[6]"),
                                (10, 5, "mpiexec", "/dev/pts/0")])
    assert prog.launcher_output_is_terminal(1, pid=30, proc=proc)


def test_a_rank_under_mpiexec_writing_to_a_log_sees_no_terminal(tmp_path):
    proc = fake_proc(tmp_path, [(30, 20, "python", "pipe:[7]"),
                                (20, 10, "hydra_pmi_proxy", "pipe:[6]"),
                                (10, 5, "mpiexec", "/home/me/job.log"),
                                (5, 1, "bash", "/dev/pts/0")])
    assert not prog.launcher_output_is_terminal(1, pid=30, proc=proc)


def test_a_pipe_to_another_program_is_not_followed(tmp_path):
    # python train.py | tee log, typed in a terminal: tee's log should get plain lines
    proc = fake_proc(tmp_path, [(30, 5, "python", "pipe:[7]"), (5, 1, "bash", "/dev/pts/0")])
    assert not prog.launcher_output_is_terminal(1, pid=30, proc=proc)
    assert not prog.launcher_output_is_terminal(1, pid=99, proc=proc)  # gone: cannot tell


# -- the loss record and plot ----------------------------------------------------------------------
def test_losses_records_every_step_and_grows_past_the_announced_total():
    progress = run_loop(Progress(2, samples_per_step=1, stream=io.StringIO(), rank=1),
                        [torch.tensor(3.0, requires_grad=True), None, 1.5])
    got = progress.losses()
    assert got.dtype == torch.float64 and len(got) == 3
    assert got[0] == 3.0 and math.isnan(got[1]) and got[2] == 1.5


def test_plot_loss_curve_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = prog.plot_loss_curve(tmp_path / "loss.png", [1.0, 0.5, 0.25], title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a loss that reaches 0 or below cannot go on a log axis: linear then, no error
    prog.plot_loss_curve(tmp_path / "signed.png", [1.0, 0.0, -1.0], title="t")
    assert (tmp_path / "signed.png").stat().st_size > 0


# -- formatting ------------------------------------------------------------------------------------
def test_formats():
    assert prog.format_loss(0.123456) == "0.12346"
    assert prog.format_loss(2.5e-5) == "2.500e-05"
    assert prog.format_duration(0.04) == "0.04 s" and prog.format_duration(12.34) == "12.3 s"
    assert prog.format_duration(3725) == "1:02:05"
    assert prog.format_bytes(512) == "512 B" and prog.format_bytes(1536) == "1.50 KiB"


# -- the optimizer's wait_seconds counter ----------------------------------------------------------
@pytest.fixture
def one_rank():
    import bagua_mpi as bm
    bm.init(abort_on_exception=False)
    yield bm
    bm.shutdown()


def small_training(bm, algorithm: str, steps: int):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), algorithm=algorithm)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    return opt


def test_wait_seconds_counts_the_wait_for_gradient_buckets(one_rank, monkeypatch):
    from bagua_mpi.algorithms import dense
    original = dense.allreduce_

    def slow_allreduce(*args, **kwargs):  # a slow link: the step has to wait for it
        time.sleep(0.05)
        return original(*args, **kwargs)
    monkeypatch.setattr(dense, "allreduce_", slow_allreduce)
    started = time.perf_counter()
    opt = small_training(one_rank, "gradient_allreduce", steps=4)
    wall = time.perf_counter() - started
    waited = opt.communication_stats()["wait_seconds"]
    assert 4 * 0.04 < waited < wall, (waited, wall)  # the sleeps, and only part of the steps
    opt.close()


def test_wait_seconds_counts_a_weight_exchange_after_the_step(one_rank, monkeypatch):
    opt = small_training(one_rank, "decentralized", steps=1)
    assert not opt.impl.communicates_gradients
    before = opt.communication_stats()["wait_seconds"]
    monkeypatch.setattr(opt.impl, "after_step", lambda optimizer: time.sleep(0.05))
    opt.zero_grad()
    opt.optimizer.param_groups[0]["params"][0].sum().backward()
    opt.step()
    assert opt.communication_stats()["wait_seconds"] - before >= 0.04
    opt.close()


def test_a_real_optimizer_on_one_rank_fills_the_summary(one_rank):
    model = torch.nn.Linear(8, 1)
    opt = one_rank.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    out = io.StringIO()
    with Progress(3, samples_per_step=4, optimizer=opt, stream=out) as progress:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            progress.step(loss)
    assert (progress.rank, progress.ranks) == (0, 1)  # bagua_mpi's, read at the block's start
    s = progress.result
    assert s.wait_seconds is not None and 0 <= s.wait_seconds <= s.wall_seconds
    assert s.bytes_sent == 0  # one rank sends nothing
    assert (s.algorithm, s.backend) == ("gradient_allreduce", "mpi")
    assert "on 1 rank; step 0 took" in out.getvalue()
    assert s.first_step_wait_seconds is not None
    assert 0 <= s.first_step_wait_seconds <= s.wait_seconds
    opt.close()
