"""Where the host's time goes during some training steps, by sampling thread stacks.

``cProfile`` sees only the thread that enables it, and a bucket's exchange runs on the
library's communication thread, so this samples ``sys._current_frames()`` from a thread of
its own (every ``interval`` seconds). It looks at two threads: the training thread, busy or
blocked inside a step the whole time, and the communication thread while it runs a job (not
while it waits for one). Per function of the library or its dependencies it counts the samples
with the function on the stack (inclusive) and those where it is the innermost such frame
(innermost). Fractions are of all samples of the two threads.

Used by ``train_all.py --profile`` in ``tests/gpu/run.sh``: the GPU check records, for each
algorithm, which calls hold the host (kernel launches, staging copies, MPI waits, Python
bookkeeping), the evidence the next change to the step time should start from.
"""
import collections
import os
import sys
import threading
import time

# the innermost frame counted is the first one in these packages' files
_ROOTS = ("bagua_mpi", "numba_kernels", "numba", "torch", "mpi4py", "numpy")
COMM_THREAD = "bagua_mpi-comm"


def _label(code) -> str:
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


def _ours(code) -> bool:
    path = code.co_filename.replace("\\", "/")
    return any(f"/{root}/" in path for root in _ROOTS)


class StackSampler:
    """``with StackSampler() as s: ...`` then ``s.report(top)``."""

    def __init__(self, interval: float = 0.0005):
        self.interval = interval
        self.inclusive = collections.Counter()
        self.innermost = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def _run(self):
        main = threading.main_thread().ident
        while not self._stop.wait(self.interval):
            comm = next((t.ident for t in threading.enumerate() if t.name == COMM_THREAD), None)
            frames = sys._current_frames()
            for ident in (main, comm):
                if ident in frames:
                    self._take(frames[ident], ident == comm)

    def _take(self, frame, comm_thread: bool):
        stack = []
        while frame is not None:
            stack.append(frame.f_code)
            frame = frame.f_back
        if comm_thread and not self._in_job(stack):
            return
        self.samples += 1
        seen = set()
        for code in stack:
            label = _label(code)
            if _ours(code) and label not in seen:
                seen.add(label)
                self.inclusive[label] += 1
        inner = next((c for c in stack if _ours(c)), stack[0])
        self.innermost[_label(inner)] += 1

    @staticmethod
    def _in_job(stack) -> bool:
        """The communication thread runs a job when something is called from its loop other
        than the queue's wait for the next one."""
        for i, code in enumerate(stack):
            if code.co_name == "_loop":
                return i > 0 and os.path.basename(stack[i - 1].co_filename) != "queue.py"
        return False

    def report(self, top: int = 12) -> dict:
        """The ``top`` functions by inclusive and by innermost share of the busy samples."""
        n = max(1, self.samples)
        return {"samples": self.samples,
                "inclusive": [[k, round(v / n, 3)] for k, v in self.inclusive.most_common(top)],
                "innermost": [[k, round(v / n, 3)] for k, v in self.innermost.most_common(top)]}


def measure(fn, steps: int, interval: float = 0.0005) -> dict:
    """Run ``fn()`` ``steps`` times under the sampler; the report and the wall time."""
    with StackSampler(interval) as sampler:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        seconds = time.perf_counter() - t0
    out = sampler.report()
    out["seconds"] = seconds
    out["steps"] = steps
    return out
