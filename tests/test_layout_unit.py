"""bagua_mpi/layout.py and the flat forms built on it, in one process: the strides a bucket
gives a gradient are those autograd gives it, and a dense tensor flattens in memory order."""
import pytest
import torch

from bagua_mpi import layout
from bagua_mpi.algorithms.forms import float32


def params():
    base = torch.randn(6, 8)
    return {
        "row-major": torch.randn(4, 3, 2, 2),
        "channels_last": torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last),
        "channels_last_3d": torch.randn(2, 3, 2, 2, 2).to(memory_format=torch.channels_last_3d),
        "transposed": torch.randn(5, 3).t(),
        "with gaps": base[:, ::2],  # not dense: autograd gives it a row-major gradient
    }


@pytest.mark.parametrize("kind", list(params()))
def test_autograd_strides_are_those_autograd_gives(kind):
    p = torch.nn.Parameter(params()[kind])
    (p * torch.arange(p.numel()).reshape(p.shape)).sum().backward()
    assert layout.autograd_strides(p) == p.grad.stride()


def shaped(flat, like):
    """``flat`` (``like``'s elements in its memory order) seen with ``like``'s shape and the
    strides autograd gives it: what a bucket's view of a parameter is."""
    return flat.as_strided(like.shape, layout.autograd_strides(like))


@pytest.mark.parametrize("kind", list(params()))
def test_memory_order_and_the_bucket_view_invert_each_other(kind):
    t = params()[kind]
    flat = layout.memory_order(t).clone()
    view = shaped(flat, t)
    assert torch.equal(view, t) and view.stride() == layout.autograd_strides(t)


@pytest.mark.parametrize("kind", list(params()))
def test_real_geometry_of_a_complex_tensor_is_its_real_view(kind):
    t = torch.complex(params()[kind], -params()[kind])
    shape, strides, numel = layout.real_geometry(t)
    real = layout.real_view(layout.memory_order(t).clone())  # (n, 2): parts side by side
    view = real.reshape(-1).as_strided(shape, strides)
    assert numel == 2 * t.numel() and layout.real_dtype(t.dtype) == torch.float32
    assert torch.equal(torch.view_as_complex(view), t)


def test_describe_names_the_formats():
    got = {kind: layout.describe(t) for kind, t in params().items()}
    assert got["row-major"] == "contiguous" and got["with gaps"] == "contiguous"
    assert got["channels_last"] == "channels_last"
    assert got["channels_last_3d"] == "channels_last_3d"
    assert got["transposed"] == "strides (1, 3)"


def test_float32_form_of_a_dense_tensor_is_a_view_in_memory_order():
    t = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    with float32(t) as flat:
        assert flat.data_ptr() == t.data_ptr()
        assert torch.equal(flat, t.permute(0, 2, 3, 1).reshape(-1))  # N, H, W, C order
        flat.mul_(2)
    assert torch.equal(t, shaped(flat, t))


def test_float32_form_of_another_dtype_is_written_back_element_by_element():
    t = torch.randn(4, 3, 2, 2, dtype=torch.float64).to(memory_format=torch.channels_last)
    before = t.clone()
    with float32(t) as flat:
        assert flat.dtype == torch.float32
        assert torch.equal(flat, before.float().permute(0, 2, 3, 1).reshape(-1))
        flat.add_(1)
    assert torch.allclose(t, before + 1) and t.stride() == before.stride()
