"""Device functions for ``sim_kernels.py``'s tests of the simulator's ``cuda`` swap: two
simulated threads inside functions of this one module at once, and a block's threads all
entering it together. Simulator only (two of them sleep)."""
import time

from numba import cuda


@cuda.jit(device=True)
def leaves_first():
    time.sleep(0.05)
    return cuda.threadIdx.x


@cuda.jit(device=True)
def stays_longer():
    time.sleep(0.1)
    return cuda.threadIdx.x


@cuda.jit(device=True)
def own_lane():
    return cuda.threadIdx.x
