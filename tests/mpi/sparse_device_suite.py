"""gTop-k's device path (numba device arrays, MPI on device buffers) against its host path.

Run with NUMBA_ENABLE_CUDASIM=1: Numba's CUDA simulator runs the device kernels on the CPU
and its device arrays expose host memory to MPI, so the same code that a GPU with a
CUDA-aware MPI runs (allocation, kernels, synchronisation, sends of device buffers) runs here.
Both paths must give the same bytes: results and residuals, with each layer an array of its
own, and with the layers as segments of one base array (each step in one launch).
"""
import os
import sys

import numpy as np
from numba import cuda

import bagua_mpi as bm
import numba_kernels as nk
from bagua_mpi.primitives.sparse import SparseBases, _gtopk_arrays
from gpu_device_suite import merges_made


def main():
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run under the CUDA simulator"
    bm.init()
    comm = bm.runtime.get().topo.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    layers = [(300, 5), (40, 1), (64, 64), (9, 0)]
    ks = [k for _, k in layers]
    host_res = [np.zeros(n, np.float32) for n, _ in layers]
    dev_res = [cuda.to_device(r) for r in host_res]
    # the same layers as segments of one base array, their residuals of another (in reverse
    # order): the selection and the decode of all of them in one launch each
    offsets = np.cumsum([2] + [n + 2 for n, _ in layers])[:-1]
    r_offsets = np.cumsum([1] + [n + 1 for n, _ in layers[::-1]])[::-1][1:]
    base_res = [np.zeros(int(r_offsets[0]) + layers[0][0], np.float32) for _ in range(2)]
    base_res[1] = cuda.to_device(base_res[1])
    for step in range(2):
        rng = np.random.default_rng([step, rank])
        grads = [(rng.standard_t(2, n) * (1 + rank)).astype(np.float32) for n, _ in layers]
        host = [g.copy() for g in grads]
        dev = [cuda.to_device(g) for g in grads]
        _gtopk_arrays(host, host_res, ks, comm, 1.0 / size, "int32", None)
        _gtopk_arrays(dev, dev_res, ks, comm, 1.0 / size, "int32", None)
        for j in range(len(layers)):
            assert np.array_equal(dev[j].copy_to_host(), host[j]), f"layer {j} step {step}"
            assert np.array_equal(dev_res[j].copy_to_host(), host_res[j]), f"residual {j}"
        for place, res in zip(("host", "device"), base_res):
            base = np.full(int(offsets[-1]) + layers[-1][0] + 2, np.nan, np.float32)
            for o, g in zip(offsets, grads):
                base[o:o + g.size] = g
            if place == "device":
                base = cuda.to_device(base)
            before = nk.launch_count()
            _gtopk_arrays(None, None, ks, comm, 1.0 / size, "int32", None,
                          SparseBases(base, list(offsets), res, list(r_offsets),
                                      [n for n, _ in layers]))
            launches = nk.launch_count() - before
            got = base.copy_to_host() if place == "device" else base
            got_res = res.copy_to_host() if place == "device" else res
            for j, (o, r, (n, _)) in enumerate(zip(offsets, r_offsets, layers)):
                what = f"{place}, in common memory: layer {j} step {step}"
                assert np.array_equal(got[o:o + n], host[j]), what
                assert np.array_equal(got_res[r:r + n], host_res[j]), what + " residual"
            # select, one merge per partner this rank merges from, decode
            if place == "device":
                assert launches == 2 + merges_made(rank, size), \
                    f"{launches} launches on rank {rank}: {what}"
        everyone = comm.allgather([h.tobytes() for h in host])
        assert all(e == everyone[0] for e in everyone), "ranks disagree"
    if rank == 0:
        print(f"sparse device suite OK on {size} ranks", flush=True)


if __name__ == "__main__":
    sys.exit(main())
