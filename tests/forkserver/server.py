"""A Python that has already imported torch, numpy, numba and h5py, and forks MPI ranks from it.

Run by the harness (``forkserver.preloaded_command``), one server per rank slot and import
environment, serving on ``argv[1]``. ``stub.py`` is what ``mpiexec`` starts in the rank's place:
it sends its argv, environment, working directory and every open descriptor (stdio and the PMI
socket ``mpiexec`` handed it), then waits. For each request:

1. the server forks a *waiter*, which receives the request and forks the *rank*;
2. the rank puts the stub's descriptors at their numbers, takes its environment, directory and
   argv, and runs the script as ``__main__``, exiting the way ``python script.py`` would (atexit
   handlers, MPI_Finalize, exit code, traceback);
3. the waiter sends the rank's pid to the stub, then its exit status, and kills the rank if the
   stub goes away first (mpiexec killed the job).

Why: every rank of every test job otherwise imports torch anew (3-4 s of CPU each; half of the
suite's time on 2 cores). The library itself is not imported here, so every environment
variable it reads is read in the rank, from the rank's own environment.

The server freezes its objects (``gc.freeze``) before it forks. Otherwise the collector of every
rank walks the server's 200,000 import-time objects: when the interpreter exits (1.2 s per
process with torch, numba and h5py loaded, 0.3 s frozen) and in every full collection, and each
walk writes to the objects' headers, so the rank copies the pages it shares with the server.
Measured on 2 cores, 4 ranks: a job that only imports mpi4py took 2.9 s, 1.0-1.1 s frozen; one
that starts and stops bagua_mpi 3.6-4.2 s, 1.9-2.1 s. The objects frozen are the server's
imports only; everything the rank creates is collected as in a fresh interpreter.
"""
from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys

import h5py  # noqa: F401  (imported to be inherited by the ranks)
import mpi4py  # noqa: F401  (the package only: mpi4py.MPI initializes MPI, which the rank does)
import numba  # noqa: F401
import numpy
import torch  # noqa: F401

PR_SET_PDEATHSIG = 1
MAX_DESCRIPTORS = 250
REQUEST_BYTES = 1 << 20


def serve(path: str) -> socket.socket:
    """Accept requests until the harness goes; return, in a waiter, the stub's connection."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(128)
    listener.settimeout(1.0)
    harness = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            if os.getppid() != harness:  # the harness died without stopping us
                sys.exit(0)
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the waiter waits for its rank
            conn.settimeout(None)
            return conn
        conn.close()


def wait_for_rank(conn: socket.socket) -> dict:
    """In the waiter: fork the rank and report on it. Returns only in the rank."""
    data, descriptors, _, _ = socket.recv_fds(conn, REQUEST_BYTES, MAX_DESCRIPTORS)
    request = json.loads(data)
    waiter = os.getpid()
    rank = os.fork()
    if rank == 0:
        conn.close()
        # the waiter only dies after the rank, unless killed: then the rank goes too
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != waiter:
            os._exit(137)
        place_descriptors(descriptors, request["fds"])
        return request
    for fd in descriptors:
        os.close(fd)
    conn.sendall(json.dumps({"pid": rank}).encode())
    status = wait_or_kill(rank, conn)
    outcome = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
               else {"exit": os.WEXITSTATUS(status)})
    try:
        conn.sendall(json.dumps(outcome).encode())
    except OSError:
        pass
    os._exit(0)


def wait_or_kill(rank: int, conn: socket.socket) -> int:
    """The rank's wait status; SIGKILL it first if the stub goes away (the job was killed)."""
    try:
        watched = [conn, os.pidfd_open(rank)]  # Linux 5.3+: readable when the rank ends
        poll_s = None
    except (AttributeError, OSError):  # older kernels: look at the rank every 0.1 s
        watched, poll_s = [conn], 0.1
    while True:
        readable, _, _ = select.select(watched, [], [], poll_s)
        if conn in readable and conn.recv(64) == b"":  # the stub was killed: so is its rank
            os.kill(rank, signal.SIGKILL)
            return os.waitpid(rank, 0)[1]
        pid, status = os.waitpid(rank, os.WNOHANG)
        if pid:
            return status


def place_descriptors(received: list[int], numbers: list[int]) -> None:
    """Give each received descriptor the number it had in the stub (PMI_FD names one)."""
    floor = max(received + numbers) + 1
    lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(lifted, numbers):
        os.dup2(fd, number)
        os.close(fd)


def become(request: dict) -> None:
    """Take the stub's directory, environment and argv; run its script as ``python`` would."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = argv
    # as a fresh interpreter builds it: the script's directory, PYTHONPATH, then the rest (the
    # server itself starts without PYTHONPATH)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0]))] + extra + sys.path[1:]
    numpy.random.seed()  # a fresh interpreter's global generator differs per process
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    gc.freeze()  # see the module docstring
    become(wait_for_rank(serve(sys.argv[1])))
