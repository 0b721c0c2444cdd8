"""cProfile of a rank's communication thread while train_all.py's check model trains.

Usage: mpiexec -n 2 python3 tests/gpu/profile_comm.py OUTDIR ALGORITHM [cpu]

Rank 0 writes OUTDIR/profile_<algorithm>.txt: the top functions by own time and by
cumulative time of the communication thread (where a compressed bucket's host work runs),
over train_all.py's steps of a second run (the first compiles the kernels; the stack sampler
shows shares, this shows calls and microseconds).  Only that thread: from Python 3.12 one
profiler at a time per process.
``cpu`` runs it on CPU tensors (a smoke test of this script).
"""
import cProfile
import io
import os
import pstats
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import bagua_mpi as bm  # noqa: E402
from bagua_mpi import worker  # noqa: E402
import train_all  # noqa: E402

COMM_THREAD = cProfile.Profile()   # the runtime has one communication thread
_loop = worker.CommWorker._loop


def _profiled_loop(self):
    COMM_THREAD.enable()
    try:
        _loop(self)
    finally:
        COMM_THREAD.disable()


def report(prof, out):
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
        out.write(f"## communication thread, by {key}\n\n```\n{s.getvalue()}\n```\n\n")


def main():
    outdir, name = sys.argv[1], sys.argv[2]
    device = torch.device("cpu") if sys.argv[3:] == ["cpu"] else torch.device("cuda", 0)
    warnings.filterwarnings("ignore", message=".*Grid size")
    worker.CommWorker._loop = _profiled_loop
    bm.init()
    comm = bm.runtime.get().topo.comm
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_all.run_one(name, comm, device, "staged")   # warm-up: compiles the kernels
    COMM_THREAD.clear()   # the communication thread waits on its queue meanwhile
    row = train_all.run_one(name, comm, device, "staged")
    rank = comm.Get_rank()
    bm.shutdown()   # ends the communication thread, and its profile
    if rank == 0:
        with open(os.path.join(outdir, f"profile_{name}.txt"), "w") as out:
            out.write(f"# {name}: step {row['step_ms_median']:.2f} ms, "
                      f"{train_all.STEPS} steps, profiled\n\n")
            report(COMM_THREAD, out)
        print(name, f"{row['step_ms_median']:.2f} ms (profiled)", flush=True)


if __name__ == "__main__":
    main()
