"""Progress of a data-parallel training loop, shown by rank 0, and a summary at the end.

    from bagua_mpi.progress import Progress, plot_loss_curve

    with Progress(args.steps, samples_per_step=args.batch * bm.size(), optimizer=opt,
                  reduce_loss=bm.allreduce) as progress:
        for step in range(args.steps):
            ...
            opt.step()
            progress.step(loss)          # every rank, every step
    losses = bm.allreduce(progress.losses())   # the per-step loss, averaged over ranks
    if bm.rank() == 0:
        plot_loss_curve("loss.png", losses.tolist(), title="my model")

Rank 0 shows a progress bar (step count, loss, samples per second, time left) when its output
goes to a terminal, and plain lines otherwise: a Slurm log gets one line every ``every`` steps
and at least every ``seconds`` seconds (step, loss, samples/s, elapsed time), not a stream of
carriage returns. The other ranks print nothing. When the block ends, rank 0 prints a summary:
steps, wall time, throughput over all ranks, the share of the time the training thread waited
for communication, bytes sent per step, and the optimizer's algorithm and backend. Step 0's
time is told apart, and throughput and waiting are given from step 1 on as well: step 0 builds
the buckets and, on the first run after an install, compiles the compression kernels, which
would otherwise read as a slow run spent waiting for communication.

Why tqdm for the bar: it is a small, well-kept library that already handles what a hand-made
bar gets wrong (terminal width and resizing, smoothing of the rate, the estimate of the time
left, writing lines above the bar). It is optional (the ``examples`` extra) and imported only
when a bar is wanted: without it the plain lines are used. matplotlib, for
``plot_loss_curve``, is optional in the same way.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import runtime

BAR, PLAIN, SILENT = "bar", "plain", "silent"

# Process names of MPI launchers and their per-node proxies (MPICH's Hydra, Open MPI/PRRTE):
# a rank's output is a pipe to one of them, which writes it to its own output.
MPI_LAUNCHERS = frozenset({"hydra_pmi_proxy", "mpiexec", "mpiexec.hydra", "mpirun",
                           "orterun", "orted", "prterun", "prted"})


# -- where the output goes -------------------------------------------------------------------------
def _fd_target(proc: Path, pid: int, fd: int) -> str:
    return os.readlink(proc / str(pid) / "fd" / str(fd))


def _parent_pid(proc: Path, pid: int) -> int:
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    return int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _command_name(proc: Path, pid: int) -> str:
    return (proc / str(pid) / "comm").read_text().strip()


def launcher_output_is_terminal(fd: int = 1, *, pid: int | None = None,
                                proc: Path = Path("/proc")) -> bool:
    """Whether this process's ``fd`` is a pipe to an MPI launcher that writes to a terminal.

    Under ``mpiexec`` no rank's output is a terminal: it is a pipe to the launcher (through a
    per-node proxy), which copies it to its own output. So ``isatty()`` alone would never show a
    bar in the main job; following the pipes up through launcher processes finds where the
    output really lands. Only launcher processes are followed: ``python train.py | tee log``
    from a terminal is a pipe to ``tee``, and the log should get plain lines. Linux only
    (``/proc``); False wherever it cannot tell.
    """
    pid = os.getpid() if pid is None else pid
    try:
        for _ in range(4):  # rank -> proxy -> launcher, with room for one more hop
            target = _fd_target(proc, pid, fd)
            if not target.startswith("pipe:"):
                return target.startswith(("/dev/pts/", "/dev/tty"))
            pid = _parent_pid(proc, pid)
            if _command_name(proc, pid) not in MPI_LAUNCHERS:
                return False
    except (OSError, ValueError, IndexError):
        pass
    return False


def output_is_terminal(stream) -> bool:
    """Whether what is written to ``stream`` ends up on a terminal (directly or via mpiexec)."""
    try:
        if stream.isatty():
            return True
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # StringIO and other streams without a file
        return False
    return fd in (1, 2) and launcher_output_is_terminal(fd)


def load_tqdm():
    """The ``tqdm`` class, or None where tqdm is not installed (plain lines then)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def choose_display(mode: str, *, rank: int, on_terminal: bool, have_tqdm: bool) -> str:
    """``BAR``, ``PLAIN`` or ``SILENT``: rank 0 alone shows anything; ``mode`` "auto" draws a bar
    on a terminal (when tqdm is installed), "bar" wherever tqdm is, "plain" never."""
    if mode not in ("auto", BAR, PLAIN):
        raise ValueError(f"mode must be 'auto', 'bar' or 'plain', got {mode!r}")
    if rank != 0:
        return SILENT
    wants_bar = mode == BAR or (mode == "auto" and on_terminal)
    return BAR if wants_bar and have_tqdm else PLAIN


# -- formatting ------------------------------------------------------------------------------------
def format_loss(loss: float | None) -> str:
    if loss is None:
        return "-"
    # fixed point keeps log lines aligned; tiny losses would all read 0.00000 in it
    return f"{loss:.5f}" if loss == 0 or abs(loss) >= 1e-3 else f"{loss:.3e}"


def format_duration(seconds: float) -> str:
    if seconds < 10:  # short runs and first lines: tenths alone would read 0.0 s
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def progress_line(step: int, loss: float | None, samples_per_second: float,
                  elapsed: float) -> str:
    """One plain progress line; ``step`` is 0-based, as the training loop's index."""
    return (f"step {step:4d}  loss {format_loss(loss)}  {samples_per_second:9.1f} samples/s  "
            f"elapsed {format_duration(elapsed)}")


# -- the summary -----------------------------------------------------------------------------------
@dataclass
class Summary:
    """What a training loop did, from rank 0's clock and rank 0's communication counters.

    ``wait_seconds`` / ``bytes_sent`` are None without an optimizer that counts them.
    ``first_step_seconds`` / ``first_step_wait_seconds``: the wall time from the block's start
    to the end of step 0, and the wait within it. Step 0 carries one-off costs (the buckets are
    built, an algorithm sets up its exchange, and the first run after an install compiles the
    compression kernels: seconds to tens of seconds), so the ``later_*`` figures leave it out,
    as a benchmark leaves out its warm-up steps."""
    steps: int
    wall_seconds: float
    samples_per_step: int
    ranks: int | None = None
    wait_seconds: float | None = None
    bytes_sent: float | None = None
    algorithm: str | None = None
    backend: str | None = None
    first_step_seconds: float | None = None
    first_step_wait_seconds: float | None = None

    @property
    def samples_per_second(self) -> float:
        """Throughput over all ranks (``samples_per_step`` counts every rank's samples)."""
        return self.steps * self.samples_per_step / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def wait_share(self) -> float | None:
        """The share of the wall time spent waiting for communication (0..1)."""
        if self.wait_seconds is None or not self.wall_seconds:
            return None
        return self.wait_seconds / self.wall_seconds

    @property
    def later_seconds(self) -> float | None:
        """The wall time from the end of step 0 to the block's end; None with fewer than two
        steps (nothing came after step 0) or where step 0's end was not seen."""
        if self.first_step_seconds is None or self.steps < 2:
            return None
        return self.wall_seconds - self.first_step_seconds

    @property
    def later_samples_per_second(self) -> float | None:
        """Throughput over all ranks from step 1 on."""
        later = self.later_seconds
        return (self.steps - 1) * self.samples_per_step / later if later else None

    @property
    def later_wait_share(self) -> float | None:
        """The share of the time from step 1 on spent waiting for communication (0..1)."""
        later = self.later_seconds
        if not later or self.wait_seconds is None or self.first_step_wait_seconds is None:
            return None
        return (self.wait_seconds - self.first_step_wait_seconds) / later

    @property
    def bytes_per_step(self) -> float | None:
        if self.bytes_sent is None or not self.steps:
            return None
        return self.bytes_sent / self.steps

    def lines(self) -> list[str]:
        """The printed summary. With a step 0 to leave out, throughput and waiting are given
        from step 1 on, each with its figure over every step beside it."""
        on = f" on {self.ranks} rank{'s' if self.ranks != 1 else ''}" if self.ranks else ""
        steps = f"{self.steps} step{'s' if self.steps != 1 else ''}"
        head = f"summary: {steps} in {format_duration(self.wall_seconds)}{on}"
        later = self.later_seconds
        if later is None:
            lines = [head, f"  throughput: {self.samples_per_second:.1f} samples/s over all "
                           f"ranks ({self.samples_per_step} samples per step)"]
            if self.wait_share is not None:
                lines.append(f"  waiting for communication: {100 * self.wait_share:.1f}% of "
                             f"the time ({self.wait_seconds:.2f} s on rank 0)")
        else:
            lines = [f"{head}; step 0 took {format_duration(self.first_step_seconds)} "
                     "(set-up, and compiles on a first run)",
                     f"  throughput from step 1 on: {self.later_samples_per_second:.1f} "
                     f"samples/s over all ranks ({self.samples_per_second:.1f} with step 0; "
                     f"{self.samples_per_step} samples per step)"]
            if self.later_wait_share is not None:
                waited = self.wait_seconds - self.first_step_wait_seconds
                lines.append(f"  waiting for communication from step 1 on: "
                             f"{100 * self.later_wait_share:.1f}% of the time ({waited:.2f} s "
                             f"on rank 0; {100 * self.wait_share:.1f}% with step 0)")
        if self.bytes_per_step is not None:
            lines.append(f"  sent per step: {format_bytes(self.bytes_per_step)} "
                         f"({self.bytes_per_step:.0f} bytes, rank 0)")
        if self.algorithm is not None or self.backend is not None:
            lines.append(f"  algorithm: {self.algorithm or '-'}, backend: {self.backend or '-'}")
        return lines


def read_communication(optimizer) -> dict:
    """``bytes_sent`` and ``wait_seconds`` from ``optimizer.communication_stats()`` (None each
    where the optimizer does not count it, e.g. op=Adasum or a plain torch optimizer)."""
    stats = {}
    if optimizer is not None and hasattr(optimizer, "communication_stats"):
        try:
            stats = optimizer.communication_stats()
        except NotImplementedError:
            stats = {}
    return {"bytes_sent": stats.get("bytes_sent"), "wait_seconds": stats.get("wait_seconds")}


def _difference(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


# -- displays --------------------------------------------------------------------------------------
class _Silent:
    def show(self, step, loss, samples_per_second, elapsed, report) -> None:
        pass

    def close(self) -> None:
        pass


class _Lines:
    """Plain lines: at every report step, and when ``seconds`` passed since the last line."""

    def __init__(self, stream, seconds: float | None):
        self.stream = stream
        self.seconds = seconds
        self.last_line_at = 0.0

    def show(self, step, loss, samples_per_second, elapsed, report) -> None:
        overdue = self.seconds is not None and elapsed - self.last_line_at >= self.seconds
        if report or overdue:
            print(progress_line(step, loss, samples_per_second, elapsed), file=self.stream,
                  flush=True)
            self.last_line_at = elapsed

    def close(self) -> None:
        pass


class _Bar:
    """A tqdm bar; the loss and samples/s are refreshed at report steps."""

    def __init__(self, tqdm, stream, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="step", file=stream, dynamic_ncols=True)

    def show(self, step, loss, samples_per_second, elapsed, report) -> None:
        if report:
            # refresh=False: tqdm redraws at its own pace, update() below is enough
            self.bar.set_postfix_str(f"loss {format_loss(loss)}, "
                                     f"{samples_per_second:.0f} samples/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# -- the helper ------------------------------------------------------------------------------------
class Progress:
    """Show a training loop's progress on rank 0 and print a summary when it ends.

    Args:
        total_steps: the steps the loop will run (the bar's length).
        samples_per_step: samples of one step over *all* ranks (batch per rank x ranks), for
            the throughput.
        optimizer: a ``DistributedOptimizer`` (or None): its ``communication_stats()`` give
            the waiting share and bytes per step of the summary, its ``algorithm.name`` and
            ``backend`` name what ran.
        every: a report every this many steps (and at the first and the last step): a plain
            line, the bar's loss and samples/s, and ``reduce_loss`` on every rank.
        seconds: plain lines also when this many seconds passed since the last one (slow
            steps; None: by step only). Decided by rank 0 alone, so no collective happens then:
            such a line shows the loss of the last report.
        reduce_loss: called by every rank at report steps with the loss tensor, e.g.
            ``bagua_mpi.allreduce`` (the mean over ranks); None shows rank 0's own loss.
        mode: "auto" (a bar on a terminal, plain lines elsewhere), "bar" or "plain".
        desc: the bar's label.
        stream: where rank 0 writes (default ``sys.stdout``).
        rank / ranks: this process's rank and the number of ranks (default: bagua_mpi's,
            0 and unknown before ``init``).
        clock: seconds as a float (tests pass a fake one).
    """

    def __init__(self, total_steps: int, samples_per_step: int, optimizer=None, *,
                 every: int = 10, seconds: float | None = 30.0, reduce_loss=None,
                 mode: str = "auto", desc: str = "train", stream=None, rank: int | None = None,
                 ranks: int | None = None, clock=time.perf_counter):
        if every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.total_steps = total_steps
        self.samples_per_step = samples_per_step
        self.optimizer = optimizer
        self.every = every
        self.seconds = seconds
        self.reduce_loss = reduce_loss
        self.mode = mode
        self.desc = desc
        self.stream = sys.stdout if stream is None else stream
        self.rank, self.ranks = rank, ranks  # None: bagua_mpi's, read when the block starts
        self.clock = clock
        self.steps = 0
        self.shown_loss: float | None = None
        self.result: Summary | None = None
        self._losses: torch.Tensor | None = None  # per-step loss, filled without a device sync
        self._display = _Silent()

    # -- the context manager ------------------------------------------------------------------
    def __enter__(self) -> Progress:
        if runtime.is_initialized():  # read here, not at construction: it may precede init()
            self.rank = runtime.rank() if self.rank is None else self.rank
            self.ranks = runtime.size() if self.ranks is None else self.ranks
        self.rank = 0 if self.rank is None else self.rank
        tqdm = load_tqdm() if self.rank == 0 else None
        display = choose_display(self.mode, rank=self.rank,
                                 on_terminal=self.rank == 0 and output_is_terminal(self.stream),
                                 have_tqdm=tqdm is not None)
        if display == BAR:
            self._display = _Bar(tqdm, self.stream, self.total_steps, self.desc)
        elif display == PLAIN:
            self._display = _Lines(self.stream, self.seconds)
        self._before = read_communication(self.optimizer)  # an optimizer may be reused
        self.started = self._last_report_at = self.clock()
        self._last_report_step = 0
        self._first_step_end: float | None = None
        self._after_first_step: dict | None = None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._display.close()
        if exc_type is None:  # after an error the traceback matters, not throughput
            self.result = self.summary()
            if self.rank == 0:
                print("\n".join(self.result.lines()), file=self.stream, flush=True)

    # -- per step -----------------------------------------------------------------------------
    def step(self, loss=None) -> None:
        """Count one finished step; ``loss`` (a tensor or a number, optional) is recorded for
        ``losses()`` and shown. Call it on every rank: ``reduce_loss`` is collective."""
        index = self.steps
        self.steps += 1
        if loss is not None:
            self._record(index, loss)
        report = index % self.every == 0 or index == self.total_steps - 1
        if report and loss is not None:
            self.shown_loss = self._reported_loss(loss)
        now = self.clock()
        if index == 0:  # step 0's one-off costs are told apart in the summary
            self._first_step_end = now
            self._after_first_step = read_communication(self.optimizer)
        rate = self._rate_since_last_report(now)
        if report:
            self._last_report_at, self._last_report_step = now, self.steps
        self._display.show(index, self.shown_loss, rate, now - self.started, report)

    def _reported_loss(self, loss) -> float:
        value = torch.as_tensor(loss).detach()
        if self.reduce_loss is not None:
            value = self.reduce_loss(value)
        return float(value)

    def _rate_since_last_report(self, now: float) -> float:
        # samples/s over the steps since the previous report: shows slow-downs a run-long
        # average would hide
        elapsed = now - self._last_report_at
        steps = self.steps - self._last_report_step
        return steps * self.samples_per_step / elapsed if elapsed > 0 else 0.0

    def _record(self, index: int, loss) -> None:
        loss = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss))
        if self._losses is None:  # on the loss's device: writing into it needs no sync
            self._losses = torch.full((max(self.total_steps, 1),), math.nan,
                                      dtype=torch.float64, device=loss.device)
        if index >= len(self._losses):  # more steps than announced: grow
            self._losses = torch.cat([self._losses, torch.full_like(self._losses, math.nan)])
        self._losses[index] = loss

    def losses(self) -> torch.Tensor:
        """This rank's loss of every step so far (CPU float64; NaN where none was given)."""
        if self._losses is None:
            return torch.full((self.steps,), math.nan, dtype=torch.float64)
        return self._losses[:self.steps].cpu()

    # -- the end --------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """The summary so far (printed by rank 0 when the block ends)."""
        after = read_communication(self.optimizer)
        algorithm = getattr(getattr(self.optimizer, "algorithm", None), "name", None)
        first_end, after_first = self._first_step_end, self._after_first_step
        return Summary(
            steps=self.steps, wall_seconds=self.clock() - self.started,
            samples_per_step=self.samples_per_step, ranks=self.ranks,
            wait_seconds=_difference(after["wait_seconds"], self._before["wait_seconds"]),
            bytes_sent=_difference(after["bytes_sent"], self._before["bytes_sent"]),
            algorithm=algorithm, backend=getattr(self.optimizer, "backend", None),
            first_step_seconds=None if first_end is None else first_end - self.started,
            first_step_wait_seconds=None if after_first is None else _difference(
                after_first["wait_seconds"], self._before["wait_seconds"]))


# -- the loss curve --------------------------------------------------------------------------------
def plot_loss_curve(path, losses, *, title: str, ylabel: str = "loss",
                    log_scale: bool | None = None) -> Path:
    """Write the loss per step to a PNG at ``path`` with matplotlib (``ImportError`` without
    it). Steps count from 0, as the progress lines do. ``log_scale`` None: logarithmic when
    every loss is positive (a falling loss spans decades)."""
    # The object API with the Agg canvas: no pyplot, so no global backend to switch and no
    # window, whatever backend the calling program chose.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    values = [float(v) for v in losses]
    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(len(values)), values, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_scale is None:
        log_scale = bool(values) and all(v > 0 for v in values)
    if log_scale:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
