"""CUDA kernels of numba_kernels.

These modules import ``numba.cuda`` at module level (the CUDA simulator finds
the ``cuda`` name in a kernel's globals to run it), so nothing outside this
package imports them until device data arrives.

How the host side reaches a CUDA twin, everywhere: a function-level import at
the point of use, ``from ._cuda import casts as kern``, inside the branch that
handles device data (the compressors' ``on_device``, each format's
``decode_device``, ``dispatch`` for its zero fill).  Chosen over
``importlib.import_module`` by name because the import stays a plain statement:
readers, linters and import-cycle checks see the edge from the public
module to its twin, and a misspelt name fails where it is written instead of
inside a string.  The lazy placement is what keeps ``import numba_kernels``
free of numba.cuda on machines without a GPU.

Layering (no module here imports a public module of the package):

* ``geometry``: block shapes; ``launch``: the counted launch and the launch
  shapes the formats share; ``scratch``: the kernels' cached scratch arrays;
* ``common``: device building blocks (and the ``fill``/``scale``/``scale_columns``
  kernels); ``word_decode``: the dense decoders the min-max, 1-bit and QSGD
  formats share;
* one module per format (``casts``, ``minmax``, ``qsgd``, ``onebit``, ``topk``)
  plus ``select``, ``merge`` and ``topk_segments`` for top-k; the rules they share with the CPU
  twins come from the package's leaf modules (``_scalar``, ``_bits``,
  ``_half_bits``, ``_chunk_rules``, ``_sparse_rules``).
"""
from .. import _simulator_blocks, _simulator_races, _simulator_warps
from .._numpy_compat import ensure_numba_cuda_can_load
from .._simulator_compat import mend_simulator

ensure_numba_cuda_can_load()
mend_simulator()
_simulator_blocks.install()   # before the race check wraps syncthreads
_simulator_warps.install()
_simulator_races.install()
