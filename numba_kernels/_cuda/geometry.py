"""Block shapes of every CUDA kernel in numba_kernels.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) blocks have 32 threads
instead of 256, because the simulator runs one Python thread per CUDA thread;
the lane count (``_scalar.LANES``), and hence every result, is the same.
With ``NUMBA_KERNELS_GPU_SHAPES=1`` as well, the simulator runs the GPU's own
shapes (256-thread blocks, 32-lane warps, several min-max teams a block) and the
warp-shuffle code paths, whose intrinsics ``_simulator_warps`` gives it: slow,
but the only way to run that code without a GPU.
Kept apart from the device functions so that ``launch.py`` can size grids
without importing the kernels that launch through it.
"""
import os

from numba import config

from .._scalar import LANES

SIM = bool(config.ENABLE_CUDASIM)
# the simulator's own small shapes and shared-memory stand-ins for warp intrinsics
SIM_SHAPES = SIM and os.environ.get("NUMBA_KERNELS_GPU_SHAPES") != "1"
THREADS = 32 if SIM_SHAPES else 256
NL = LANES // THREADS          # lanes per thread
# Threads that one shuffle butterfly combines in the block reductions that any order may take
# (``common.tree_range``): a warp, and 8 in the simulator's shapes, so that its 32-thread
# blocks still combine several warps' results, as a GPU's 256-thread blocks do.
WARP = 8 if SIM_SHAPES else 32
# The min-max encoder gives each chunk a team of TEAM threads instead of a block: a warp on a
# GPU, which finds the chunk's range by shuffles alone, with no block barrier (the whole
# 32-thread block in the simulator's shapes, which use no shuffles).  TEAMS per block.
TEAM = 32
TEAMS = THREADS // TEAM
ITEMS = 16                     # elements per thread in tiled (selection) kernels
TILE = THREADS * ITEMS
# The decoders give each thread ILP elements THREADS apart per pass and load all of them before
# using any: a decode is a few dependent loads per element, so one element per thread leaves
# too few bytes in flight to cover the memory latency.
ILP = 4
ILP_SPAN = THREADS * ILP       # elements a block covers per pass
# The min-max, 1-bit and (chunk a multiple of GROUP) QSGD decoders (``word_decode``) take
# elements in groups of GROUP consecutive ones, GROUPS groups a thread per pass: a group's codes
# come in one word load, where one element's took a load of their own.  (Four groups a thread
# took 64 registers, 80 on float64 data; two take 40 and 48.)
GROUP = 4
GROUPS = 2
GROUP_ILP = GROUP * GROUPS     # elements a thread takes per pass
GROUP_SPAN = THREADS * GROUPS  # groups a block covers per pass


def blocks_for(n, per_block):
    """Number of blocks that cover n items, at least 1."""
    return max(1, -(-n // per_block))
