"""gTop-k's device path (numba device arrays, MPI on device buffers) against its host path.

Run with NUMBA_ENABLE_CUDASIM=1: Numba's CUDA simulator runs the device kernels on the CPU
and its device arrays expose host memory to MPI, so the same code that a GPU with a
CUDA-aware MPI runs (allocation, kernels, synchronisation, sends of device buffers) runs here.
Both paths must give the same bytes: results and residuals.
"""
import os
import sys

import numpy as np
from numba import cuda

import bagua_mpi as bm
from bagua_mpi.primitives.sparse import _gtopk_arrays


def main():
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run under the CUDA simulator"
    bm.init()
    comm = bm.runtime.get().topo.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    layers = [(300, 5), (40, 1), (64, 64)]
    host_res = [np.zeros(n, np.float32) for n, _ in layers]
    dev_res = [cuda.to_device(r) for r in host_res]
    for step in range(2):
        rng = np.random.default_rng([step, rank])
        grads = [(rng.standard_t(2, n) * (1 + rank)).astype(np.float32) for n, _ in layers]
        host = [g.copy() for g in grads]
        dev = [cuda.to_device(g) for g in grads]
        ks = [k for _, k in layers]
        _gtopk_arrays(host, host_res, ks, comm, 1.0 / size, "int32", None)
        _gtopk_arrays(dev, dev_res, ks, comm, 1.0 / size, "int32", None)
        for j in range(len(layers)):
            assert np.array_equal(dev[j].copy_to_host(), host[j]), f"layer {j} step {step}"
            assert np.array_equal(dev_res[j].copy_to_host(), host_res[j]), f"residual {j}"
        everyone = comm.allgather([h.tobytes() for h in host])
        assert all(e == everyone[0] for e in everyone), "ranks disagree"
    if rank == 0:
        print(f"sparse device suite OK on {size} ranks", flush=True)


if __name__ == "__main__":
    sys.exit(main())
