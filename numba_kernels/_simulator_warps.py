"""Warp intrinsics for Numba's CUDA simulator: ``syncwarp``, ``ballot_sync``, ``shfl_xor_sync``.

The simulator runs each CUDA thread as a Python thread and has block barriers only, so the
kernels' warp-shuffle code (a GPU's) could not run without a GPU. Here the lanes of a warp meet
at a barrier of their own: each lane posts its value and the name of the call, all of them read
what they need, and a second barrier keeps the next call from overwriting a value not yet read.

A GPU leaves undefined, and often hangs on, what this turns into a ``WarpDivergence`` error naming
the block, the warp and the call: lanes of one warp in different warp calls, or a lane that never
arrives (a divergent branch, a lane that returned early) within ``NUMBA_KERNELS_WARP_TIMEOUT``
seconds (60 by default). Only the full mask is taken: every lane of the warp in the call, which
is how the kernels use them. As the simulator itself does, this assumes one kernel runs at a time
(its blocks run one after another).
"""
import os
import threading

import numpy as np

from ._simulator_races import WARP_SIZE, warp_call_made
from .errors import WarpDivergence

FULL_MASK = 0xFFFFFFFF
TIMEOUT = float(os.environ.get("NUMBA_KERNELS_WARP_TIMEOUT", "60"))


class _Warp:
    def __init__(self, lanes):
        self.barrier = threading.Barrier(lanes)
        self.values = [None] * lanes
        self.calls = [None] * lanes


_lock = threading.Lock()


def _warp_of(thread):
    """The running block's warp ``thread`` belongs to, made at its first warp call. The warps
    live on the launch's block manager, for its running block only: a new launch or block
    starts afresh, whatever an earlier one left (a barrier broken by a divergence)."""
    manager = thread._manager
    block = tuple(thread.blockIdx)
    index = thread.thread_id // WARP_SIZE
    with _lock:
        running = getattr(manager, "_numba_kernels_warps", None)
        if running is None or running[0] != block:
            running = manager._numba_kernels_warps = (block, {})
        warps = running[1]
        warp = warps.get(index)
        if warp is None:
            threads = int(np.prod(manager._block_dim))
            warp = warps[index] = _Warp(min(WARP_SIZE, threads - index * WARP_SIZE))
        return warp


def _where(thread, call):
    return f"{call} in block {tuple(thread.blockIdx)}, warp {thread.thread_id // WARP_SIZE}"


def _meet(warp, thread, call):
    try:
        warp.barrier.wait(TIMEOUT)
    except threading.BrokenBarrierError:
        raise WarpDivergence(
            f"{_where(thread, call)}: not every lane of the warp arrived within {TIMEOUT:g} s (a "
            "divergent branch, or lanes that returned early)") from None


def _exchange(call, mask, value):
    """(every lane's value, this lane): the warp's lanes post ``value`` and read all of them."""
    thread = threading.current_thread()
    if mask != FULL_MASK:
        raise NotImplementedError(f"{_where(thread, call)}: mask {mask:#x}; the simulator's warp "
                                  "intrinsics take the full mask only")
    warp = _warp_of(thread)
    lane = thread.thread_id % WARP_SIZE
    warp.values[lane] = value
    warp.calls[lane] = call
    _meet(warp, thread, call)
    warp_call_made(thread)         # the race check's clock: the warp's lanes have all arrived
    values, calls = list(warp.values), list(warp.calls)
    _meet(warp, thread, call)
    if len(set(calls)) > 1:
        raise WarpDivergence(f"{_where(thread, call)}: the warp's lanes made different warp "
                             f"calls: {sorted(set(calls))}")
    return values, lane


def syncwarp(self, mask=FULL_MASK):
    _exchange("syncwarp", mask, None)


def ballot_sync(self, mask, predicate):
    values, _ = _exchange("ballot_sync", mask, bool(predicate))
    return np.uint32(sum(1 << j for j, v in enumerate(values) if v))


def shfl_xor_sync(self, mask, value, lane_mask):
    values, lane = _exchange("shfl_xor_sync", mask, value)
    source = lane ^ int(lane_mask)
    return values[source] if source < len(values) else value


def install():
    """Give the simulator's ``cuda`` module these intrinsics (only where the simulator runs)."""
    from numba import config
    if not config.ENABLE_CUDASIM:
        return
    from numba.cuda.simulator.kernelapi import FakeCUDAModule
    FakeCUDAModule.syncwarp = syncwarp
    FakeCUDAModule.ballot_sync = ballot_sync
    FakeCUDAModule.shfl_xor_sync = shfl_xor_sync
