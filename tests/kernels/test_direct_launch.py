"""``launch`` (numba_kernels/_cuda/launch.py) starts a kernel's compiled overload directly once
Numba's dispatcher has launched it for arguments of the same kinds.

A real Numba dispatcher needs a GPU; the simulator's kernels have no compiled overloads, so
there every launch takes the dispatcher (checked at the end).  These tests drive ``launch``
with a stand-in that has the dispatcher's interface as numba-cuda has it (``kernel[grid,
block, stream](*args)``, ``overloads`` keyed by argument types, ``typeof_pyval``, a
configuration's converted ``stream``; a compiled kernel's ``launch(args, griddim, blockdim,
stream, sharedmem)``) and record which way each launch went, with what.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import numba_kernels
from numba_kernels._cuda import launch as launcher


class FakeDeviceArray:
    """What ``launch`` reads of a Numba device array: the marker, dtype, rank and flags."""
    __cuda_ndarray__ = True

    def __init__(self, host):
        self.host = host
        self.dtype, self.ndim = host.dtype, host.ndim
        self.flags = {"C_CONTIGUOUS": host.flags.c_contiguous,
                      "F_CONTIGUOUS": host.flags.f_contiguous}


class Compiled:
    def __init__(self, dispatcher, types):
        self.dispatcher, self.types = dispatcher, types

    def launch(self, args, griddim, blockdim, stream, sharedmem):
        self.dispatcher.log.append(("direct", self.types, griddim, blockdim, stream, sharedmem,
                                    args))


class Configured:
    def __init__(self, dispatcher, grid, block, stream):
        self.dispatcher, self.grid, self.block = dispatcher, grid, block
        self.stream = ("converted", stream)
        dispatcher.conversions += 1

    def __call__(self, *args):
        d = self.dispatcher
        types = tuple(d.typeof_pyval(a) for a in args)
        d.overloads.setdefault(types, Compiled(d, types))     # compiles on a new signature
        d.log.append(("dispatcher", types, self.grid, self.block, self.stream[1], args))


class FakeDispatcher:
    specialized = False

    def __init__(self, **attrs):
        self.overloads, self.log, self.conversions = {}, [], 0
        self.__dict__.update(attrs)

    def __getitem__(self, config):
        return Configured(self, *config)

    @staticmethod
    def typeof_pyval(a):
        if isinstance(a, FakeDeviceArray):
            layout = "C" if a.flags["C_CONTIGUOUS"] else "F" if a.flags["F_CONTIGUOUS"] else "A"
            return ("array", str(a.dtype), a.ndim, layout)
        return type(a).__name__


@pytest.fixture(autouse=True)
def fresh_caches(monkeypatch):
    monkeypatch.setattr(launcher, "_COMPILED", {})
    monkeypatch.setattr(launcher, "_STREAMS", {})


def ways(kernel):
    return [entry[0] for entry in kernel.log]


def arr(dtype=np.float32, shape=(8,)):
    return FakeDeviceArray(np.zeros(shape, dtype))


def test_the_second_launch_of_the_same_kinds_starts_the_compiled_kernel_with_its_arguments():
    k = FakeDispatcher()
    x, y = arr(), arr()
    numba_kernels.reset_launch_count()
    launcher.launch(k, 4, 256, 0, x, np.float32(0.5), 8)
    launcher.launch(k, (5, 2), 128, 0, y, np.float32(0.25), 16)
    assert ways(k) == ["dispatcher", "direct"]
    _, types, grid, block, stream, shared, args = k.log[1]
    assert types == k.log[0][1]
    assert (grid, block, stream, shared) == ((5, 2, 1), (128, 1, 1), ("converted", 0), 0)
    assert args[0] is y and args[1:] == (np.float32(0.25), 16)
    assert numba_kernels.launch_count() == 2


def test_grid_sizes_given_as_numpy_integers_reach_the_launch_as_python_ints():
    k = FakeDispatcher()
    launcher.launch(k, 1, 256, 0, arr())
    launcher.launch(k, (np.int64(3), np.int32(2)), np.int64(64), 0, arr())
    _, _, grid, block, *_ = k.log[1]
    assert grid == (3, 2, 1) and block == (64, 1, 1)
    assert all(type(v) is int for v in grid + block)


@pytest.mark.parametrize("base, other", [
    pytest.param(lambda: (arr(), 8), lambda: (arr(np.float64), 8), id="dtype"),
    pytest.param(lambda: (arr(), 8), lambda: (arr(shape=(4, 4)), 8), id="rank"),
    pytest.param(lambda: (arr(shape=(4, 4)), 8),
                 lambda: (FakeDeviceArray(np.zeros((4, 8), np.float32)[:, ::2]), 8),
                 id="layout"),
    pytest.param(lambda: (arr(), 8), lambda: (arr(), 8.0), id="scalar type"),
])
def test_arguments_of_another_kind_go_through_the_dispatcher_and_get_their_own_overload(
        base, other):
    k = FakeDispatcher()
    launcher.launch(k, 1, 32, 0, *base())
    launcher.launch(k, 1, 32, 0, *other())
    launcher.launch(k, 1, 32, 0, *other())
    launcher.launch(k, 1, 32, 0, *base())
    assert ways(k) == ["dispatcher", "dispatcher", "direct", "direct"]
    assert k.log[2][1] == k.log[1][1] != k.log[0][1]    # the overload Numba picked for them
    assert k.log[3][1] == k.log[0][1]


def test_an_argument_the_key_cannot_describe_always_takes_the_dispatcher():
    k = FakeDispatcher()
    for _ in range(3):
        launcher.launch(k, 1, 32, 0, arr(), [1, 2])
    assert ways(k) == ["dispatcher"] * 3


@pytest.mark.parametrize("attrs", [{"specialized": True}, {"_launch_config_sensitive": True}],
                         ids=["specialized", "launch-configuration sensitive"])
def test_kernels_numba_dispatches_by_configuration_always_take_the_dispatcher(attrs):
    k = FakeDispatcher(**attrs)
    for _ in range(3):
        launcher.launch(k, 1, 32, 0, arr())
    assert ways(k) == ["dispatcher"] * 3


def test_a_debug_or_cooperative_compiled_kernel_is_not_launched_directly():
    k = FakeDispatcher()
    launcher.launch(k, 1, 32, 0, arr())
    compiled = next(iter(k.overloads.values()))
    compiled.debug = True
    launcher._COMPILED.clear()
    launcher.launch(k, 1, 32, 0, arr())
    launcher.launch(k, 1, 32, 0, arr())
    assert ways(k) == ["dispatcher"] * 3


def test_a_stream_is_converted_once_per_handle_and_each_handle_gets_its_own():
    k = FakeDispatcher()
    launcher.launch(k, 1, 32, 7, arr())
    launcher.launch(k, 1, 32, 7, arr())
    launcher.launch(k, 1, 32, 7, arr())
    launcher.launch(k, 1, 32, 9, arr())
    assert [e[4] for e in k.log] == [7, ("converted", 7), ("converted", 7), ("converted", 9)]
    assert k.conversions == 3    # the first launch configures; then one per handle


SIMULATED = """
import numpy as np
from numba import cuda
from numba_kernels._cuda import launch as launcher

@cuda.jit
def add_one(x, n):
    i = cuda.grid(1)
    if i < n:
        x[i] += 1

x = cuda.to_device(np.zeros(4, np.float32))
for _ in range(3):
    launcher.launch(add_one, 1, 32, 0, x, 4)
assert set(launcher._COMPILED.values()) == {False}, launcher._COMPILED
assert x.copy_to_host().tolist() == [3.0] * 4, x.copy_to_host()
print("ok")
"""


def test_under_the_simulator_every_launch_takes_the_dispatcher_and_computes():
    """The simulator's kernels have no compiled overloads: the direct path stays off, and
    the kernel still runs each time (in a child process: the simulator is chosen at import)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", SIMULATED], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
