"""The NumPy alias numba-cuda needs to load its typing registries (numpy 2.5 removed it)."""
import numpy as np

from numba_kernels._numpy_compat import ensure_numba_cuda_can_load


def test_row_stack_restored_as_vstack_when_numpy_lacks_it(monkeypatch):
    monkeypatch.delattr(np, "row_stack", raising=False)
    ensure_numba_cuda_can_load()
    assert np.row_stack is np.vstack
    a, b = np.arange(3.0), np.arange(3.0, 6.0)
    np.testing.assert_array_equal(np.row_stack([a, b]), [[0, 1, 2], [3, 4, 5]])


def test_existing_row_stack_left_alone(monkeypatch):
    def own(*args, **kwargs):
        return "numpy's own"

    monkeypatch.setattr(np, "row_stack", own, raising=False)
    ensure_numba_cuda_can_load()
    assert np.row_stack is own


def test_loading_the_device_kernels_applies_it(monkeypatch):
    """The kernels package restores the alias on import, before any kernel compiles."""
    import importlib

    import numba_kernels._cuda as device_kernels

    monkeypatch.delattr(np, "row_stack", raising=False)
    importlib.reload(device_kernels)
    assert np.row_stack is np.vstack
