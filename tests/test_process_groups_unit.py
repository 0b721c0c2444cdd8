"""The process groups' point-to-point batches, on recording stand-ins for torch's backends.

NCCL's side (a backend that coalesces) runs only on a GPU: the GPU check exchanges with itself in
one group call at world size 1, and between ranks it needs two GPUs. gloo's runs for real under
mpiexec (``transport_suite.py``'s exchange and send/receive checks through gloo).
Here each backend kind's sequence of calls is checked: NCCL's transfers inside one group call
(so torch uses the group's communicator, not one per pair of ranks), gloo's all posted before
any is waited on (so no rank waits on a transfer its peer has not reached).
"""
import inspect
import re

import pytest
import torch

from bagua_mpi.process_groups import ProcessGroup


class _Work:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def wait(self):
        self.log.append(("wait",) + self.what)


class _RecordingBackend:
    def __init__(self, coalescing: bool):
        self.supports_coalescing = coalescing
        self.log = []
        self.coalescing = False

    # the signatures of torch's Backend binding (test below), which ProcessGroupNCCL keeps
    def _start_coalescing(self):
        assert not self.coalescing, "nested coalescing"
        self.coalescing = True
        self.log.append(("start",))

    def _end_coalescing(self):
        assert self.coalescing, "end without start"
        self.coalescing = False
        self.log.append(("end",))
        return _Work(self.log, ("batch",))

    def send(self, tensors, peer, tag):
        self.log.append(("send", peer, tag, tensors[0].data_ptr()))
        return _Work(self.log, ("send", peer))

    def recv(self, tensors, peer, tag):
        self.log.append(("recv", peer, tag, tensors[0].data_ptr()))
        return _Work(self.log, ("recv", peer))


def _group(coalescing: bool) -> ProcessGroup:
    group = object.__new__(ProcessGroup)  # the backend only: no communicator, no store
    group.pg = _RecordingBackend(coalescing)
    group.rank, group.size = 2, 5
    return group


def _exchange(group):
    send = torch.ones(8)
    recvs = [torch.empty(8) for _ in range(3)]
    group.exchange(send, recvs, [4, 0, 3], tag=9)
    return send, recvs


def test_a_coalescing_backend_gets_the_whole_exchange_in_one_group_call():
    group = _group(coalescing=True)
    send, recvs = _exchange(group)
    log = group.pg.log
    assert log[0] == ("start",) and log[-2:] == [("end",), ("wait", "batch")], log
    inside = log[1:-2]
    assert sorted(op[:3] for op in inside if op[0] == "recv") == [
        ("recv", 0, 9), ("recv", 3, 9), ("recv", 4, 9)], log
    assert sorted(op[:3] for op in inside if op[0] == "send") == [
        ("send", 0, 9), ("send", 3, 9), ("send", 4, 9)], log
    received = {op[1]: op[3] for op in inside if op[0] == "recv"}
    assert received == {4: recvs[0].data_ptr(), 0: recvs[1].data_ptr(),
                        3: recvs[2].data_ptr()}, "each peer's message into its own buffer"
    assert all(op[3] == send.data_ptr() for op in inside if op[0] == "send")


def test_a_backend_without_coalescing_has_every_transfer_posted_before_any_wait():
    group = _group(coalescing=False)
    _exchange(group)
    log = group.pg.log
    posts = [op for op in log if op[0] in ("send", "recv")]
    waits = [op for op in log if op[0] == "wait"]
    assert log == posts + waits, f"a wait came before the last transfer was posted: {log}"
    assert sorted(w[1:] for w in waits) == sorted(p[:2] for p in posts), "each one waited on"
    assert not any(op[0] in ("start", "end") for op in log)


@pytest.mark.parametrize("coalescing", [True, False])
def test_a_lone_send_or_receive_is_a_batch_of_one(coalescing):
    """gTop-k's tree and the binomial broadcast send and receive one message at a time: on
    NCCL each is a group call of one transfer too, on the group's communicator."""
    group = _group(coalescing)
    t = torch.zeros(4)
    group.send(t, 1, tag=5)
    group.recv(t, 3, tag=6)
    log = group.pg.log
    if coalescing:
        assert [op[:2] for op in log] == [("start",), ("send", 1), ("end",), ("wait", "batch"),
                                          ("start",), ("recv", 3), ("end",),
                                          ("wait", "batch")], log
    else:
        assert [op[:2] for op in log] == [("send", 1), ("wait", "send"), ("recv", 3),
                                          ("wait", "recv")], log


@pytest.mark.parametrize("coalescing", [True, False])
def test_an_exchange_without_peers_calls_nothing(coalescing):
    group = _group(coalescing)
    group.exchange(torch.zeros(2), [], [], tag=1)
    assert group.pg.log == []


@pytest.mark.parametrize("method", ["_start_coalescing", "_end_coalescing", "send", "recv"])
def test_the_stand_in_takes_what_torchs_backend_binding_takes(method):
    """The stand-in's methods take the arguments torch's ``Backend`` binding takes (which
    ``ProcessGroupNCCL`` inherits; a CPU build of torch has no NCCL class to read), so a
    call that passes here cannot fail on NCCL for its arguments. The coalescing calls take
    no device there, unlike ``ProcessGroup``'s."""
    from torch._C._distributed_c10d import Backend
    signature = getattr(Backend, method).__doc__.splitlines()[0]
    torch_params = re.findall(r"(\w+):", signature[signature.index("("):signature.rindex(")")])
    ours = list(inspect.signature(getattr(_RecordingBackend, method)).parameters)
    assert len(ours) == len(torch_params), (signature, ours)


def test_the_plane_moves_bytes_of_contiguous_buffers_and_refuses_others():
    """The transport hands a process group the bytes of what it moves (gloo and NCCL refuse
    some dtypes, not their bytes); a strided buffer is refused by name, since a copy would
    keep a receive's data from it."""
    import numpy as np

    from bagua_mpi.transport import _bytes, _flat
    words = np.arange(6, dtype=np.uint16)
    moved = _bytes(words)
    assert moved.dtype == torch.uint8 and moved.numel() == 12
    assert moved.data_ptr() == torch.from_numpy(words).data_ptr(), "a view, not a copy"
    with pytest.raises(ValueError, match=r"contiguous buffers, got one of shape \(4, 3\)"):
        _bytes(torch.zeros(3, 4).t())
    with pytest.raises(ValueError, match="contiguous buffers"):  # the reductions' buffers too
        _flat(torch.zeros(3, 4).t())
