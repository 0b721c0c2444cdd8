"""The NCCL bootstrap over MPI, without NCCL: rank 0 starts the TCPStore, its address goes
out with mpi4py, every rank joins the same store. ``ProcessGroupNCCL`` is replaced by a stand-in
that checks, through the store it is given, that all ranks of the group met there (the real
class needs a GPU per rank; ``tests/gpu/nccl_check.py`` runs it at world size 1). The backend's
choice (``init``, ``DistributedOptimizer``, ``auto``) is checked beside it.

Each check initializes the library and shuts it down itself (some check ``init``'s own errors),
so ``checks.run_checks`` agrees on their outcomes over ``MPI.COMM_WORLD`` and reports each on its
own line.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import backends, process_groups
from bagua_mpi.exceptions import ConfigError
from checks import run_checks


class MeetingPoint:
    """Stands in for ``ProcessGroupNCCL``: every rank meets in the group's store, and the
    group's options and first allreduce (which makes NCCL's communicator) are recorded."""
    made = []
    allreduced = []
    timeouts = []
    stopped = []  # (rank, "shutdown" or "abort")

    class Options:  # ProcessGroupNCCL.Options: torch's default timeout is 10 minutes
        def __init__(self):
            self._timeout = datetime.timedelta(minutes=10)

    def __init__(self, store, rank, size, options):
        store.set(f"here/{rank}", str(rank))
        seen = [int(store.get(f"here/{j}").decode()) for j in range(size)]  # waits for all
        assert seen == list(range(size)), seen
        self.rank = rank
        MeetingPoint.made.append((rank, size))
        MeetingPoint.timeouts.append(options._timeout)

    def allreduce(self, tensors, opts):
        MeetingPoint.allreduced.append((self.rank, tuple(t.numel() for t in tensors)))
        return Done()

    def shutdown(self):
        MeetingPoint.stopped.append((self.rank, "shutdown"))

    def abort(self):
        MeetingPoint.stopped.append((self.rank, "abort"))


class Done:
    def wait(self):
        return True


def check_optimizer_choice(rank, size):
    """DistributedOptimizer(backend=): unknown names and a missing GPU/NCCL fail at wrap time,
    naming what is missing; "mpi" trains as before; the choice reaches the dense steps."""
    from bagua_mpi.algorithms import dense
    bm.init()
    original = dense.allreduce_
    try:
        torch.manual_seed(0)  # the same start on every rank (the first step compares them)
        model = torch.nn.Linear(4, 2)

        def wrap(backend):
            return bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           backend=backend)
        try:
            wrap("ucc")
            raise AssertionError("backend='ucc' was accepted")
        except backends.BackendError as exc:
            assert "valid: auto, mpi, nccl, nccl_hierarchical, gloo" in str(exc), exc
        if not torch.cuda.is_available():
            try:
                wrap("nccl")
                raise AssertionError("backend='nccl' was accepted without a GPU")
            except backends.BackendUnavailableError as exc:
                assert "needs a CUDA GPU" in str(exc), exc
        opt = wrap("mpi")
        assert opt.impl.backend == "mpi"
        seen = []

        def spy(t, comm, **kw):
            seen.append(kw.get("backend"))
            return original(t, comm, **kw)
        dense.allreduce_ = spy
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.close()
        assert seen and set(seen) == {"mpi"}, seen
    finally:
        dense.allreduce_ = original
        bm.shutdown()


def check_init_errors(rank, size):
    """init(backend=) and BAGUA_MPI_BACKEND: an unknown name, a malformed variable and (where
    there is no GPU) a NCCL choice fail at init with a named error, leaving nothing
    initialized; init(backend="mpi") then takes MPI, and shutdown forgets the choice."""
    cases = [(dict(backend="ucc"), None, backends.BackendError, "valid: auto, mpi, nccl"),
             ({}, "ncl", ConfigError, "BAGUA_MPI_BACKEND='ncl'")]
    if not torch.cuda.is_available():  # with a GPU these two are valid choices
        cases += [(dict(backend="nccl"), None, backends.BackendUnavailableError,
                   "needs a CUDA GPU"),
                  ({}, "nccl_hierarchical", backends.BackendUnavailableError,
                   "needs a CUDA GPU")]
    for kwargs, env, error, words in cases:
        if env is not None:
            os.environ["BAGUA_MPI_BACKEND"] = env
        try:
            bm.init(**kwargs)
            bm.shutdown()
            raise AssertionError(f"init({kwargs}) with BAGUA_MPI_BACKEND={env} was accepted")
        except error as exc:
            assert words in str(exc), exc
        finally:
            os.environ.pop("BAGUA_MPI_BACKEND", None)
        assert not bm.is_initialized()
    bm.init(backend="mpi")
    try:
        assert backends.resolve() == "mpi"
    finally:
        bm.shutdown()
    assert backends._default is None, "shutdown forgets init's choice"


def check_auto_tells_gpus_apart_by_id(rank, size):
    """``init`` gathers which GPU each local rank maps to, and ``auto`` takes NCCL exactly
    where no two ranks of a node share one. The ranks here pretend to have GPUs: each sees
    one (device_count 1, as under slurm/bind_gpu.sh), first a GPU of its own on every rank
    (NCCL everywhere, where counting 1 GPU against 2 local ranks took MPI), then one GPU per
    node that its ranks share (MPI on a node of two ranks, naming them; NCCL on a node of
    one)."""
    saved = backends.gpu_of, backends.nccl_missing, torch.cuda.device_count
    backends.nccl_missing = lambda: None
    torch.cuda.device_count = lambda: 1
    try:
        for shared in (False, True):
            backends.gpu_of = (lambda local_rank, world=rank, shared=shared:
                               ("GPU-node" if shared else f"GPU-rank{world}", "FakeGPU"))
            bm.init()
            try:
                topo = bm.runtime.get().topo
                name, why = backends.auto_device_backend()
                if shared and topo.local_size > 1:
                    listed = f"local ranks 0-{topo.local_size - 1} on one GPU"
                    assert name == "mpi" and listed in why, why
                else:
                    assert name == "nccl", why
                    assert (f"each of {topo.local_size} local rank(s) has a GPU of its own"
                            in why), why
                if not shared:
                    models_on_one_gpu(topo)
            finally:
                bm.shutdown()
    finally:
        backends.gpu_of, backends.nccl_missing, torch.cuda.device_count = saved


def models_on_one_gpu(topo):
    """Ranks that init mapped to GPUs of their own put their models on one GPU per node (a
    script without set_device): wrapping an optimizer compares the models' GPUs on each
    node, warns, and auto takes MPI there."""
    import logging
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("bagua_mpi.backends").addHandler(handler)
    saved = backends.model_gpu
    backends.model_gpu = lambda param: ("GPU-node", "FakeGPU")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters()).close()
    finally:
        backends.model_gpu = saved
        logging.getLogger("bagua_mpi.backends").removeHandler(handler)
    name, why = backends.auto_device_backend()
    if topo.local_size > 1:
        listed = f"local ranks 0-{topo.local_size - 1} on one GPU"
        assert name == "mpi" and why.startswith(listed), why
        assert any("set_device" in m for m in said), said
    else:
        assert name == "nccl" and not said, (why, said)


def check_nccl_bootstrap_meets_in_one_store(rank, size):
    """Each NCCL group (the job's, and the hierarchical mode's node group) is made once per
    communicator in a store every rank of it joins, makes its communicator while every rank is
    there, and keeps the job's stall limit as torch's watchdog timeout."""
    for record in (MeetingPoint.made, MeetingPoint.allreduced, MeetingPoint.timeouts):
        record.clear()
    bm.init()
    missing = object()  # a CPU build of torch has no ProcessGroupNCCL
    saved = getattr(dist, "ProcessGroupNCCL", missing)
    dist.ProcessGroupNCCL = MeetingPoint
    try:
        topo = bm.runtime.get().topo
        g = process_groups.group(topo.comm, "nccl")
        assert g is process_groups.group(topo.comm, "nccl"), "one group per communicator"
        assert (g.rank, g.size) == (topo.rank, topo.size)
        process_groups.group(topo.intra, "nccl")  # the hierarchical mode's node group
        assert MeetingPoint.made == [(topo.rank, topo.size), (topo.local_rank, topo.local_size)]
        # each group's communicator made while every rank is there: a batch of point-to-point
        # transfers between some ranks (gTop-k's tree) needs it to exist already
        assert MeetingPoint.allreduced == [(topo.rank, (1,)), (topo.local_rank, (1,))], \
            MeetingPoint.allreduced
        # torch's NCCL watchdog keeps the job's stall limit (the library's cannot see the device)
        after = bm.runtime.get().watchdog.abort_after
        limit = datetime.timedelta(seconds=after + process_groups.timeout_margin(after))
        assert MeetingPoint.timeouts == [limit, limit], (MeetingPoint.timeouts, limit)
    finally:
        # rank 0 of each group serves its store: it stays until every rank is done with it
        MPI.COMM_WORLD.Barrier()
        if saved is missing:
            del dist.ProcessGroupNCCL
        else:
            dist.ProcessGroupNCCL = saved
        backends.reset()
        bm.shutdown()


def check_groups_take_the_jobs_stall_limit_as_their_timeout(rank, size):
    """NCCL's and gloo's groups both time out just past the job's stall limit (10 s, or 5%
    of a long one, later: the library's abort, with its report, comes first), and never where
    it is 0 ("never"): torch's NCCL watchdog would end the job at its 10-minute default, and
    a gloo operation would fail at 30 minutes, past which the library aborts the job."""
    missing = object()  # a CPU build of torch has no ProcessGroupNCCL
    saved = getattr(dist, "ProcessGroupNCCL", missing)
    dist.ProcessGroupNCCL = MeetingPoint
    try:
        for limit, want in ((3600.0, datetime.timedelta(hours=1, minutes=3)),
                            (0.0, process_groups.NEVER), (45.0, datetime.timedelta(seconds=55))):
            MeetingPoint.timeouts.clear()
            bm.init(stall_abort_s=limit)
            try:
                comm = bm.runtime.get().topo.comm
                process_groups.group(comm, "nccl")
                gloo = process_groups.group(comm, "gloo").pg
                assert MeetingPoint.timeouts == [want], (limit, MeetingPoint.timeouts)
                assert gloo.options._timeout == want, (limit, gloo.options._timeout)
            finally:
                MPI.COMM_WORLD.Barrier()  # rank 0 of each group serves its store
                backends.reset()
                bm.shutdown()
        assert process_groups.NEVER >= datetime.timedelta(days=365)
    finally:
        if saved is missing:
            del dist.ProcessGroupNCCL
        else:
            dist.ProcessGroupNCCL = saved


def _group_over(comm, library="gloo"):
    """The library's group over ``comm``, or the exception that building it raised."""
    try:
        return process_groups.group(comm, library)
    except Exception as exc:  # noqa: BLE001 - handed back for the check to look at
        return exc


def check_a_store_no_other_host_can_reach_fails_every_rank(rank, size):
    """Ranks on several hosts whose rank 0 has only a loopback address (no default route, its
    name resolving to 127.0.1.1) raise ``StoreUnreachableError`` on every rank, naming
    ``BAGUA_MPI_STORE_ADDR``, instead of waiting to connect there; with the variable set they
    meet at its address. One host: the loopback serves."""
    import socket
    saved = (MPI.Get_processor_name, socket.socket, socket.gethostbyname,
             os.environ.get("BAGUA_MPI_STORE_ADDR"))

    def no_route(*args, **kwargs):
        raise OSError("stand-in: Network is unreachable")

    MPI.Get_processor_name = lambda: f"host{rank}"   # every rank on a host of its own
    socket.socket, socket.gethostbyname = no_route, lambda name: "127.0.1.1"
    comm = MPI.COMM_WORLD.Dup()
    try:
        got = _group_over(comm)
        if size == 1:   # one host: the loopback
            assert isinstance(got, process_groups.ProcessGroup), got
        else:
            assert isinstance(got, process_groups.StoreUnreachableError), got
            assert "BAGUA_MPI_STORE_ADDR" in str(got) and f"rank {rank}:" in str(got), got
            os.environ["BAGUA_MPI_STORE_ADDR"] = "127.0.0.1"   # where these hosts meet
            got = _group_over(comm)
            assert isinstance(got, process_groups.ProcessGroup), got
        x = torch.full((3,), float(rank + 1))
        got.allreduce_(x)
        assert torch.equal(x, torch.full((3,), size * (size + 1) / 2)), x
    finally:
        MPI.Get_processor_name, socket.socket, socket.gethostbyname, addr = saved
        os.environ.pop("BAGUA_MPI_STORE_ADDR", None)
        if addr is not None:
            os.environ["BAGUA_MPI_STORE_ADDR"] = addr
        MPI.COMM_WORLD.Barrier()   # rank 0 serves the store until every rank is done
        process_groups.forget([comm])
        comm.Free()


def _group_over_failing_store(fails, message):
    """The gloo group over a duplicate of ``COMM_WORLD``, or the exception building it raised,
    with ``TCPStore`` raising ``message`` (formatted with the host and port) wherever
    ``fails(is_master)``."""
    real = dist.TCPStore

    def store(host, port, world, is_master, **kwargs):
        if fails(is_master):
            raise RuntimeError(message.format(host=host, port=port))
        return real(host, port, world, is_master=is_master, **kwargs)

    dist.TCPStore = store
    comm = MPI.COMM_WORLD.Dup()
    try:
        return _group_over(comm)
    finally:
        dist.TCPStore = real
        MPI.COMM_WORLD.Barrier()   # rank 0 serves the store until every rank is done
        process_groups.forget([comm])
        comm.Free()


def check_a_rank_that_cannot_reach_the_store_fails_every_rank(rank, size):
    """The last rank's connection to rank 0's store fails (a stand-in for a firewall or a
    wrong address): every rank raises ``StoreUnreachableError`` naming that rank and its
    error, rather than the others going on into NCCL's set-up to wait for it."""
    last = size - 1
    got = _group_over_failing_store(lambda is_master: not is_master and rank == last,
                                    "stand-in: connect to {host}:{port} timed out")
    if size == 1:   # rank 0 serves its own store: nothing to reach
        assert isinstance(got, process_groups.ProcessGroup), got
    else:
        assert isinstance(got, process_groups.StoreUnreachableError), got
        text = str(got)
        assert f"rank(s) [{last}]" in text and "stand-in: connect" in text, text
        assert f"rank {rank}:" in text, text


def check_a_store_rank_0_cannot_serve_fails_every_rank(rank, size):
    """Rank 0 cannot start the store (a stand-in for an address not on its host, or no free
    port): every rank raises ``StoreUnreachableError`` with rank 0's error, where the others
    waited for an address that never came."""
    got = _group_over_failing_store(lambda is_master: is_master, "stand-in: cannot bind {host}")
    assert isinstance(got, process_groups.StoreUnreachableError), got
    text = str(got)
    assert "rank 0 could not serve" in text and "stand-in: cannot bind" in text, text
    assert f"rank {rank}:" in text and "BAGUA_MPI_STORE_ADDR" in text, text


def check_groups_are_shut_down_in_one_order_on_every_rank(rank, size):
    """shutdown and a removed set's forget shut the library's groups down (NCCL's and gloo's)
    rather than leave them to torch's destructor, which aborts NCCL's communicator under queued
    work and warns; in the order of their stores, whatever order each rank made them in (here
    reversed on odd ranks), since NCCL's abort was collective in some versions. A clean leave
    shuts down, a failing one aborts."""
    missing = object()
    saved = getattr(dist, "ProcessGroupNCCL", missing)
    dist.ProcessGroupNCCL = MeetingPoint
    closed = []
    original = process_groups.ProcessGroup.close

    def recording(group, finish=True):
        closed.append(group.order)
        return original(group, finish)

    process_groups.ProcessGroup.close = recording
    try:
        for finish in (True, False):
            MeetingPoint.stopped.clear()
            closed.clear()
            bm.init()
            comm = bm.runtime.get().topo.comm
            spare = comm.Dup()
            made = [process_groups.group(c, library) for c in (comm, spare)
                    for library in ("nccl", "gloo")]
            if rank % 2:   # as if another thread had made them in another order here
                with process_groups._lock:
                    items = list(process_groups._groups.items())
                    process_groups._groups.clear()
                    process_groups._groups.update(reversed(items))
            MPI.COMM_WORLD.Barrier()
            process_groups.forget([spare])
            left = {id(g) for g in process_groups.groups()}
            assert len(closed) == 2 and left == {id(g) for g in made[:2]}, closed
            spare.Free()
            backends.reset(finish=finish)
            assert len(closed) == 4 and not process_groups.groups(), closed
            orders = MPI.COMM_WORLD.allgather(closed)
            assert all(seen == orders[0] for seen in orders), orders
            kind = "shutdown" if finish else "abort"
            assert MeetingPoint.stopped == [(rank, "shutdown"), (rank, kind)], \
                MeetingPoint.stopped
            bm.shutdown()
    finally:
        process_groups.ProcessGroup.close = original
        if saved is missing:
            del dist.ProcessGroupNCCL
        else:
            dist.ProcessGroupNCCL = saved


def check_a_closed_async_optimizer_leaves_no_group_or_buffers(rank, size):
    """Asynchronous model averaging over gloo, made and closed three times: its exchange
    thread's group (over a communicator of its own, which close frees) goes with it, and once
    dropped the closed optimizer (three model-sized buffers) is collected, where shutdown's
    callback list kept it alive until the end of the job."""
    import gc
    import weakref

    from bagua_mpi.algorithms import AsyncModelAverage
    bm.init(backend="gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        gone = []
        for _ in range(3):
            opt = bm.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.01),
                named_parameters=model.named_parameters(),
                algorithm=AsyncModelAverage(sync_interval_ms=0, max_staleness=1))
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(8, 16)).sum().backward()
                opt.step()
            own = opt.impl._comm
            if size > 1:   # one rank exchanges nothing: no group
                assert any(g.comm is own for g in process_groups.groups()), "no group of its own"
            opt.close()
            stale = [g for g in process_groups.groups() if g.comm is own or g.comm == MPI.COMM_NULL]
            assert not stale, f"{len(stale)} group(s) over the closed optimizer's communicator"
            gone.append(weakref.ref(opt.impl))
            del opt
        gc.collect()
        alive = [ref for ref in gone if ref() is not None]
        assert not alive, f"{len(alive)} closed optimizer(s) still held"
    finally:
        bm.shutdown()


# every check_ function above, by name
CHECKS = {name.removeprefix("check_").replace("_", "-"): fn
          for name, fn in list(globals().items()) if name.startswith("check_")}


if __name__ == "__main__":
    sys.exit(1 if run_checks(CHECKS, comm=MPI.COMM_WORLD) else 0)
