"""``device_arrays.kept``: payload buffers kept from exchange to exchange, per thread and name
(on the host here; the device path runs under the CUDA simulator in the GPU-path suites)."""
import threading

import numpy as np
import pytest

from bagua_mpi.primitives import device_arrays


@pytest.fixture(autouse=True)
def fresh():
    device_arrays.release_kept()
    yield
    device_arrays.release_kept()


def test_the_same_name_and_shape_is_the_same_array_each_call():
    a = device_arrays.kept("t send", (3, 5), np.uint8, False)
    a[:] = 7
    b = device_arrays.kept("t send", (3, 5), np.uint8, False)
    assert b is a and b.shape == (3, 5) and b.dtype == np.uint8


def test_names_in_use_together_get_memory_apart():
    send = device_arrays.kept("t send", 64, np.uint8, False)
    recv = device_arrays.kept("t recv", 64, np.uint8, False)
    merged = device_arrays.kept("t send", 16, np.float32, False)  # another dtype: its own
    assert not np.shares_memory(send, recv)
    assert not np.shares_memory(send, merged)


def test_a_larger_ask_grows_the_buffer_and_smaller_ones_then_view_it():
    small = device_arrays.kept("t payload", 10, np.float32, False)
    large = device_arrays.kept("t payload", (4, 25), np.float32, False)
    assert large.shape == (4, 25) and not np.shares_memory(small, large)
    again = device_arrays.kept("t payload", 10, np.float32, False)
    assert again.shape == (10,) and np.shares_memory(again, large)
    assert device_arrays.kept("t payload", 0, np.float32, False).shape == (0,)


def test_every_thread_has_its_own_buffers():
    mine = device_arrays.kept("t send", 32, np.uint8, False)
    theirs = []
    worker = threading.Thread(
        target=lambda: theirs.append(device_arrays.kept("t send", 32, np.uint8, False)))
    worker.start()
    worker.join()
    assert not np.shares_memory(mine, theirs[0])


def test_many_shapes_start_the_views_again_over_the_same_memory(monkeypatch):
    monkeypatch.setattr(device_arrays, "_VIEWS_KEPT", 16)
    first = device_arrays.kept("t rows", (1, 64), np.uint8, False)
    # more shapes than a buffer remembers views of, none larger than the first
    for shape in [(rows, 1) for rows in range(1, 65)] + [(1, cols) for cols in range(2, 9)]:
        assert np.shares_memory(first, device_arrays.kept("t rows", shape, np.uint8, False))
    again = device_arrays.kept("t rows", (1, 64), np.uint8, False)
    assert again is not first   # its view was made again
    assert again.shape == (1, 64) and np.shares_memory(first, again)


def test_released_buffers_are_not_handed_out_again():
    before = device_arrays.kept("t send", 32, np.uint8, False)
    device_arrays.release_kept()
    after = device_arrays.kept("t send", 32, np.uint8, False)
    assert not np.shares_memory(before, after)


def test_the_host_and_each_gpu_have_buffers_of_their_own(monkeypatch):
    """GPU 0's index is 0, which Python takes as equal to False: the host's buffer must still
    not be handed out for the device, nor one GPU's for another."""
    made = []

    def empty(shape, dtype, device):
        made.append(device)
        return np.empty(shape, dtype)   # standing in for a device array here

    gpu = [0]
    monkeypatch.setattr(device_arrays, "empty", empty)
    monkeypatch.setattr(device_arrays, "_current_gpu", lambda: gpu[0])
    host = device_arrays.kept("t send", 8, np.uint8, False)
    on_gpu0 = device_arrays.kept("t send", 8, np.uint8, True)
    gpu[0] = 1
    on_gpu1 = device_arrays.kept("t send", 8, np.uint8, True)
    assert made == [False, True, True]
    assert not np.shares_memory(host, on_gpu0) and not np.shares_memory(on_gpu0, on_gpu1)
    gpu[0] = 0
    assert device_arrays.kept("t send", 8, np.uint8, True) is on_gpu0
