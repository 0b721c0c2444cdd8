"""Lossy compressors Q over flat float32 data, as the primitives use them.

A ``Codec`` wraps one ``numba_kernels`` compressor: it knows its wire format for n elements (a
fixed-size uint8 payload, so receive buffers are sized before data arrives), compresses with
optional fused error feedback into a caller's buffer, and decodes a stack of payloads with
summation (the "server" side of a scatter-reduce).  Its row forms serve the scatter-reduce's
two other ends: ``compress_rows`` encodes the n partitions of a tensor into the n rows of a
payload matrix and ``decompress_rows`` decodes each row into its partition, one kernel launch
each on a device instead of n, byte for byte the per-partition calls.
"""
from __future__ import annotations

import functools
import os
import zlib
from dataclasses import dataclass

import numpy as np

import numba_kernels as nk

_threads_per_rank: int | None = None


def fit_kernel_threads() -> None:
    """Give the CPU kernels at most cores / ranks-on-this-node threads, in the calling thread.

    Numba's parallel regions spin; with several ranks per node each taking every core (4
    ranks x 2 OpenMP threads on 2 cores, with MPI busy-polling too) min-max compression of
    1.6M floats took 14 ms instead of 1.9 ms. The setting is per thread in Numba, so every
    thread that compresses calls this (a cheap check after the first time). The first call
    also starts Numba's thread pool, once per process (``_start_numba_threads``).
    """
    global _threads_per_rank
    import numba   # here, not at the top: importing numba costs every rank about 0.3 s
    if _threads_per_rank is None:
        from .. import backends, config
        forced = config.kernel_threads()
        local = backends.local_ranks()
        _threads_per_rank = forced if forced else max(1, (os.cpu_count() or 1) // local)
        _threads_per_rank = min(_threads_per_rank, numba.config.NUMBA_NUM_THREADS)
        _start_numba_threads()
    if numba.get_num_threads() != _threads_per_rank:
        numba.set_num_threads(_threads_per_rank)


def _start_numba_threads() -> None:
    """Start Numba's thread pool here, leaving this thread's torch thread count as it was.

    Numba's OpenMP layer starts its pool by setting the calling thread's OpenMP thread count
    to NUMBA_NUM_THREADS, and never sets it back. That thread is usually the communication
    thread, and torch's CPU operations there (PowerSGD's matrix products, for one) then ran
    with one OpenMP thread a core whatever OMP_NUM_THREADS said: on 2 cores with 2 ranks,
    PowerSGD's step took 128 ms instead of 3.4 ms once a compressed exchange had run before it
    in the process (``benchmarks/results/kernel_threads.md``)."""
    import numba
    import torch
    before = torch.get_num_threads()
    numba.get_num_threads()   # starts the pool, once per process (a lookup afterwards)
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


class Codec:
    name = "codec"

    def format(self, n: int):
        """The wire format of n elements. The codecs keep the formats they made (an LRU
        cache: codecs are few and immutable), since C_LP_S asks for each segment's several
        times per step."""
        raise NotImplementedError

    def compress(self, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None = None,
                 seed: int = 0):
        """Encode float32 ``x`` into ``out`` (uint8, ``format(len(x)).nbytes``)."""
        raise NotImplementedError

    def decompress_many(self, stack: np.ndarray, n: int, out: np.ndarray,
                        accumulate: bool = False, cols: slice | None = None,
                        factor: float = 1.0) -> np.ndarray:
        """out (+)= sum of the decoded rows of ``stack`` ((rows, nbytes) uint8); with ``cols``
        (a slice of ``format(n).nbytes`` bytes at an aligned column), of ``stack[:, cols]`` for
        a (rows, width) ``stack``, read in place (no copy of the columns); with ``factor``
        (not accumulating), out = factor x the sum, in the decoder's own launch."""
        fit_kernel_threads()
        return nk.decompress_many(stack, self.format(n), out=out, accumulate=accumulate,
                                  col=0 if cols is None else cols.start, factor=factor)

    def compress_rows(self, x, out, cols: slice, residual=None, seed: int = 0, rank: int = 0,
                      phase: int = 1):
        """Partition k of ``x`` into ``out[k, cols]``, every k: the bytes of
        ``compress(x_k, out[k, cols], residual=residual_k, seed=call_seed(seed, rank, k,
        phase))``, x_k of P = ceil(len(x) / rows) elements (the last ones zero-padded, without
        a copy), residual_k its slice of the residual (rows * P elements). ``out`` is a
        (rows, width) uint8 matrix, ``cols`` a slice of ``format(P).nbytes`` bytes at an
        aligned column. One kernel launch for every partition on a device (the codecs' row
        forms in numba_kernels)."""
        raise NotImplementedError

    def decompress_rows(self, stack, cols: slice, n: int, out):
        """out[k*n:(k+1)*n] = decode(stack[k, cols]) for every row k (each row on its own, not
        summed; one kernel launch on a device)."""
        fit_kernel_threads()
        return nk.decompress_rows(stack, self.format(n), out=out, col=cols.start)

    def ratio(self, n: int) -> float:
        """Bytes of float32 data per byte of payload."""
        return 4.0 * n / max(1, self.format(n).nbytes)


@dataclass(frozen=True)
class MinMaxCodec(Codec):
    """Per-chunk min-max quantization to ``bits`` bits (ByteGrad at 8 bits)."""

    bits: int = 8
    chunk: int = 1024
    name = "minmax"

    @functools.lru_cache(maxsize=256)  # see Codec.format
    def format(self, n):
        return nk.MinMaxFormat(n, self.bits, self.chunk)

    def compress(self, x, out, residual=None, seed=0):
        fit_kernel_threads()
        return nk.compress_minmax(x, bits=self.bits, chunk=self.chunk, residual=residual, out=out)

    def compress_rows(self, x, out, cols, residual=None, seed=0, rank=0, phase=1):
        fit_kernel_threads()
        return nk.compress_minmax_rows(x, out, cols.start, bits=self.bits, chunk=self.chunk,
                                       residual=residual)


@dataclass(frozen=True)
class QSGDCodec(Codec):
    """QSGD: stochastic rounding to ``levels`` levels of the chunk norm (unbiased)."""

    levels: int = 127
    chunk: int = 1024
    name = "qsgd"

    @functools.lru_cache(maxsize=256)  # see Codec.format
    def format(self, n):
        return nk.QSGDFormat(n, self.levels, self.chunk)

    def compress(self, x, out, residual=None, seed=0):
        fit_kernel_threads()
        return nk.compress_qsgd(x, levels=self.levels, chunk=self.chunk, seed=seed,
                                residual=residual, out=out)

    def compress_rows(self, x, out, cols, residual=None, seed=0, rank=0, phase=1):
        # row k's seed is nk.row_seed(seed, rank, k, phase) == call_seed(seed, rank, k, phase)
        fit_kernel_threads()
        return nk.compress_qsgd_rows(x, out, cols.start, levels=self.levels, chunk=self.chunk,
                                     row_seeds=(seed, rank, phase), residual=residual)


@dataclass(frozen=True)
class OneBitCodec(Codec):
    """Sign bits, 32 to a word, and one scale per chunk (||x||2/sqrt(n) by default)."""

    chunk: int = 4096
    scale: str = "l2"
    name = "onebit"

    @functools.lru_cache(maxsize=256)  # see Codec.format
    def format(self, n):
        return nk.OneBitFormat(n, self.chunk)

    def compress(self, x, out, residual=None, seed=0):
        fit_kernel_threads()
        return nk.compress_onebit(x, chunk=self.chunk, scale=self.scale, residual=residual,
                                  out=out)

    def compress_rows(self, x, out, cols, residual=None, seed=0, rank=0, phase=1):
        fit_kernel_threads()
        return nk.compress_onebit_rows(x, out, cols.start, chunk=self.chunk, scale=self.scale,
                                       residual=residual)


def call_seed(*parts: int | str) -> int:
    """A 31-bit seed that differs per (algorithm seed, step, parameter names, rank, partition,
    ...). A string part (the names a tensor covers) counts by the CRC-32 of its UTF-8 bytes:
    unlike ``hash()``, which Python salts per process, that is the same on every rank and run.
    (``numba_kernels.row_seed(a, b, k, c)`` is ``call_seed(a, b, k, c)`` for ints, which is how
    ``Codec.compress_rows`` seeds partition k on the device without a copy of the seeds.)"""
    words = [zlib.crc32(p.encode()) if isinstance(p, str) else p for p in parts]
    return zlib.crc32(np.asarray(words, dtype=np.int64).tobytes()) & 0x7FFFFFFF
