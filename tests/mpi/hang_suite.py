"""Hang reports: a rank out of step is named, with the operation it is in or last finished.

``python hang_suite.py MODE CULPRIT [SLEEP_S]`` on every rank, under a short
``BAGUA_MPI_STALL_WARNING_S`` (and ``BAGUA_MPI_STALL_ABORT_S``). Every mode runs two warm-up
allreduces (ops #1 and #2 on every rank), then rank CULPRIT steps out of line at op #3, where
the others call ``allreduce(ones(7), Sum)``:

  skip   CULPRIT never calls it: it goes on with its own MPI code (a raw barrier on
         COMM_WORLD that no one else joins); the watchdog aborts the job, every rank dumps
         its flight record
  other  CULPRIT calls ``barrier()`` instead, with the agreement check off on every rank (with
         it on, the library raises MismatchError rather than hang); aborted likewise
  sleep  CULPRIT sleeps SLEEP_S (between the warning and the abort time), then joins: the job
         ends cleanly after the others' warnings named it
"""
import sys
import time

import torch
from mpi4py import MPI

import bagua_mpi as bm

def warm_up() -> None:
    bm.allreduce(torch.ones(1), bm.Sum)  # op #1
    bm.allreduce(torch.ones(2), bm.Sum)  # op #2


def the_op_others_wait_in(size: int) -> None:
    out = bm.allreduce(torch.ones(7), bm.Sum)  # op #3
    assert out.tolist() == [float(size)] * 7


def mode_skip(rank, size, culprit):
    warm_up()
    if rank == culprit:
        print(f"rank {rank} skips op #3", flush=True)
        MPI.COMM_WORLD.Barrier()  # its own MPI code, which no other rank joins
        return
    the_op_others_wait_in(size)


def mode_other(rank, size, culprit):
    bm.set_consistency_check(False)  # every rank: the check would raise MismatchError instead
    warm_up()
    if rank == culprit:
        print(f"rank {rank} calls barrier() as op #3", flush=True)
        bm.barrier()
        return
    the_op_others_wait_in(size)


def mode_sleep(rank, size, culprit, seconds="3.5"):
    warm_up()
    if rank == culprit:
        print(f"rank {rank} sleeps {seconds} s before op #3", flush=True)
        time.sleep(float(seconds))
    the_op_others_wait_in(size)
    bm.barrier()
    if rank == 0:
        print(f"sleep OK on {size} ranks", flush=True)


def main():
    bm.init()
    mode, culprit = sys.argv[1], int(sys.argv[2])
    {"skip": mode_skip, "other": mode_other, "sleep": mode_sleep}[mode](
        bm.rank(), bm.size(), culprit, *sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
