"""gTop-k's device path (numba device arrays, MPI on device buffers) against its host path.

Run with NUMBA_ENABLE_CUDASIM=1: Numba's CUDA simulator runs the device kernels on the CPU
and its device arrays expose host memory to MPI, so the same code that a GPU with a
CUDA-aware MPI runs (allocation, kernels, synchronisation, sends of device buffers) runs here.
Both paths must give the same bytes: results and residuals, with each layer an array of its
own, and with the layers as segments of one base array (each step in one launch). Each check
reports on its own line (``checks.run_suite``).
"""
import os
import sys

import numpy as np
from numba import cuda

import bagua_mpi as bm
import numba_kernels as nk
from bagua_mpi.primitives.sparse import SparseBases, _gtopk_arrays
from checks import run_suite
from gpu_device_suite import merges_made


LAYERS = [(300, 5), (40, 1), (64, 64), (9, 0)]  # (elements, k) of each layer
KS = [k for _, k in LAYERS]


def the_comm():
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run under the CUDA simulator"
    return bm.runtime.get().topo.comm


def step_gradients(step, rank):
    rng = np.random.default_rng([step, rank])
    return [(rng.standard_t(2, n) * (1 + rank)).astype(np.float32) for n, _ in LAYERS]


def host_path(grads, residuals, comm):
    """The oracle: the host path, each layer an array of its own (residuals kept across calls)."""
    host = [g.copy() for g in grads]
    _gtopk_arrays(host, residuals, KS, comm, 1.0 / comm.Get_size(), "int32", None)
    everyone = comm.allgather([h.tobytes() for h in host])
    assert all(e == everyone[0] for e in everyone), "ranks disagree"
    return host


def check_layers_apart(rank, size):
    """Each layer an array of its own on the device: the host path's bytes, residuals too."""
    comm = the_comm()
    host_res = [np.zeros(n, np.float32) for n, _ in LAYERS]
    dev_res = [cuda.to_device(r) for r in host_res]
    for step in range(2):
        grads = step_gradients(step, rank)
        host = host_path(grads, host_res, comm)
        dev = [cuda.to_device(g) for g in grads]
        _gtopk_arrays(dev, dev_res, KS, comm, 1.0 / size, "int32", None)
        for j in range(len(LAYERS)):
            assert np.array_equal(dev[j].copy_to_host(), host[j]), f"layer {j} step {step}"
            assert np.array_equal(dev_res[j].copy_to_host(), host_res[j]), f"residual {j}"


def check_layers_in_common_memory(rank, size):
    """The layers as segments of one base array, their residuals of another (in reverse order),
    on the host and on the device: the selection and the decode of all of them in one launch
    each, and the host path's bytes."""
    comm = the_comm()
    offsets = np.cumsum([2] + [n + 2 for n, _ in LAYERS])[:-1]
    r_offsets = np.cumsum([1] + [n + 1 for n, _ in LAYERS[::-1]])[::-1][1:]
    base_res = [np.zeros(int(r_offsets[0]) + LAYERS[0][0], np.float32) for _ in range(2)]
    base_res[1] = cuda.to_device(base_res[1])
    host_res = [np.zeros(n, np.float32) for n, _ in LAYERS]
    for step in range(2):
        grads = step_gradients(step, rank)
        host = host_path(grads, host_res, comm)
        for place, res in zip(("host", "device"), base_res):
            base = np.full(int(offsets[-1]) + LAYERS[-1][0] + 2, np.nan, np.float32)
            for o, g in zip(offsets, grads):
                base[o:o + g.size] = g
            if place == "device":
                base = cuda.to_device(base)
            before = nk.launch_count()
            _gtopk_arrays(None, None, KS, comm, 1.0 / size, "int32", None,
                          SparseBases(base, list(offsets), res, list(r_offsets),
                                      [n for n, _ in LAYERS]))
            launches = nk.launch_count() - before
            got = base.copy_to_host() if place == "device" else base
            got_res = res.copy_to_host() if place == "device" else res
            for j, (o, r, (n, _)) in enumerate(zip(offsets, r_offsets, LAYERS)):
                what = f"{place}, in common memory: layer {j} step {step}"
                assert np.array_equal(got[o:o + n], host[j]), what
                assert np.array_equal(got_res[r:r + n], host_res[j]), what + " residual"
            # select, one merge per partner this rank merges from, decode
            if place == "device":
                assert launches == 2 + merges_made(rank, size), \
                    f"{launches} launches on rank {rank}: {what}"


# every check_ function above, by name
CHECKS = {name.removeprefix("check_").replace("_", "-"): fn
          for name, fn in list(globals().items()) if name.startswith("check_")}


if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
