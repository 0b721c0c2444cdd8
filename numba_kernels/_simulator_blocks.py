"""Block barriers for Numba's CUDA simulator without its polling loop.

The simulator runs a block's threads as Python threads. Its block manager learns that they have
all reached ``syncthreads`` (or ended) by checking every thread in a loop that never sleeps,
and that loop takes the interpreter lock from the very threads it waits for: in a cProfile of
one rank of ``tests/mpi/gpu_device_suite.py --check clps`` at 2 ranks, 16 of its 26 s went to the
loop's ``Thread.is_alive`` calls and lock acquisitions.

Here the threads count themselves at the barrier under a condition variable. The last live
thread to arrive opens it, as does a thread's end that leaves every live one waiting, and the
launching thread sleeps until the block has ended. The semantics are the simulator's: a barrier
opens once every thread still running has reached it (threads that returned do not hold it
shut), and the first thread to raise aborts the others at their next barrier and has its
exception raised by the launch, without waiting for the rest. As the simulator itself does,
this assumes one kernel runs at a time (its blocks run one after another).
"""
import threading

import numpy as np


class _Block:
    """One running block's barrier, kept on its block manager."""

    def __init__(self, threads):
        self.cond = threading.Condition()
        self.live = len(threads)   # threads not yet ended
        self.waiting = 0           # live threads in the current barrier
        self.generation = 0        # barriers opened so far
        self.failure = None        # the first exception raised in the block, with its traceback
        self.threads = threads

    def open_if_every_live_thread_waits(self):
        """With ``cond`` held."""
        if self.waiting and self.waiting == self.live:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()


def _syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = self._manager._numba_kernels_block
    with block.cond:
        generation = block.generation
        block.waiting += 1
        block.open_if_every_live_thread_waits()
        while block.generation == generation and not self.abort:
            block.cond.wait()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _run_thread(self):
    try:
        _original_thread_run(self)   # stores an exception raised by the kernel in .exception
    finally:
        block = self._manager._numba_kernels_block
        with block.cond:
            block.live -= 1
            if self.exception is not None and block.failure is None:
                block.failure = self.exception
                for thread in block.threads:
                    thread.abort = True
            block.open_if_every_live_thread_waits()
            block.cond.notify_all()   # aborted threads, and the launching thread


def _run_block(self, grid_point, *args):
    from numba.cuda.simulator.kernel import BlockThread

    def target():
        self._f(*args)
    threads = [BlockThread(target, self, grid_point, block_point, self._debug)
               for block_point in np.ndindex(*self._block_dim)]
    block = self._numba_kernels_block = _Block(threads)
    for thread in threads:
        thread.start()
    with block.cond:
        while block.live and block.failure is None:
            block.cond.wait()
    if block.failure is not None:
        raise block.failure[0].with_traceback(block.failure[1])


_original_thread_run = None


def install():
    """Replace the simulator's polling block manager (only where the simulator runs). Before
    the race check's install, which wraps ``syncthreads`` as it finds it."""
    global _original_thread_run
    from numba import config
    if not config.ENABLE_CUDASIM or _original_thread_run is not None:
        return
    from numba.cuda.simulator import kernel
    _original_thread_run = kernel.BlockThread.run
    kernel.BlockThread.run = _run_thread
    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockManager.run = _run_block
