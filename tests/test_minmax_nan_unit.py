"""A NaN in one rank's gradient stays a NaN through min-max compression, so a loss scaler skips.

Min-max's rule (``numba_kernels.minmax``): a NaN anywhere in a chunk makes the chunk's range,
and so its parameters and every element of its decode, NaN. Here two ranks' gradients, one
holding a NaN, are compressed with error feedback by ``MinMaxCodec`` (ByteGrad's 8 bits,
L-GreCo's narrower widths) and averaged as the exchange decodes them (the payload stack summed
times 1/2, which every rank does alike): the average is NaN in the NaN's chunk and exact
elsewhere, and ``torch.amp.GradScaler`` given it skips the step and lowers its scale, as it
would without compression. The range used to drop the NaN: a finite average, a step taken.
"""
import numpy as np
import pytest
import torch

from bagua_mpi.primitives.codecs import MinMaxCodec

N, CHUNK = 3000, 1024


def exchanged_average(codec, grads):
    """Each rank's gradient compressed with a fresh error memory; the stack's decode halved."""
    stack = np.zeros((len(grads), codec.format(N).nbytes), np.uint8)
    residuals = [np.zeros(N, np.float32) for _ in grads]
    for row, (g, e) in enumerate(zip(grads, residuals)):
        codec.compress(g, stack[row], residual=e)
    avg = np.empty(N, np.float32)
    codec.decompress_many(stack, N, avg, factor=1 / len(grads))
    return avg, residuals


def scaler_step(avg):
    """One GradScaler step of a model whose only gradient is ``avg``: (stepped, scale after)."""
    model = torch.nn.Linear(N, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))            # the scale's lazy set-up, as a scaled loss does
    model.weight.grad = torch.from_numpy(avg.copy()).view_as(model.weight)
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    return not torch.equal(before, model.weight.detach()), scaler.get_scale()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("pos", [0, 517, 992, 1023, 2999])
def test_a_nan_gradient_makes_the_scaler_skip_the_step(bits, pos):
    codec = MinMaxCodec(bits, CHUNK)
    rng = np.random.default_rng([bits, pos])
    grads = [rng.standard_normal(N).astype(np.float32) * 1024 for _ in range(2)]
    clean, _ = exchanged_average(codec, grads)
    assert np.isfinite(clean).all()
    assert scaler_step(clean) == (True, 1024.0)
    grads[1][pos] = np.nan
    avg, residuals = exchanged_average(codec, grads)
    chunk = np.arange(N) // CHUNK == pos // CHUNK
    assert np.isnan(avg[chunk]).all()
    np.testing.assert_array_equal(avg[~chunk], clean[~chunk])
    # the NaN rank's error memory is NaN over the chunk (dropped with the skipped step), the
    # other rank's as without the NaN
    assert np.isnan(residuals[1][chunk]).all() and np.isfinite(residuals[0]).all()
    assert scaler_step(avg) == (False, 512.0)
